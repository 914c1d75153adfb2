// A launch plan's replay in C++ (mok_compile/kernels/plan_cpp.py builds this file and translates each Plan).
//
// The Python replay (plan.py, Plan.replay) spends most of its host time in the Python around each step: an
// allocation or a slice from Python costs 3-8 us, against about 1 us through the same ATen call from C++, and a
// Triton launch 5 us or more of Python before the driver's call (benchmarks/NOTES-gpu.md v68 (5), v69). This
// replays the same steps, with the same ATen functions, in the same order, on the same tensors:
//
//   ATen steps     empty, empty_like, slice of dim 0, detach, t, view, reshape, transpose, contiguous, to(dtype),
//                  new_empty, mm, addmm, linear, matmul, _grouped_mm: the calls the Python replay makes through
//                  the public functions, which dispatch to these.
//   launches       Triton's C launch function, called with the argument tuple `_DirectLaunch` builds in Python:
//                  the recorded constants, the stream, each tensor's address as an int (what Triton's launcher
//                  reads of a tensor), and each descriptor's TMA map, kept by address in the step's own dict
//                  (a miss calls back into Python, which encodes the map); for Triton 3.7 and later, the kernel's
//                  arguments as one tuple at the end.
//   effects        free_storage: a tensor's storage resized to 0 bytes, as `untyped_storage().resize_(0)` does
//                  (its memory back to the allocator; the consuming backward's release of h).
//   Python steps   any other step (an op as recorded, a side effect, a launch through `kernel.run`) calls back
//                  into Python with the tensors it reads and appends the new tensors it returns.
//
// Each slot is dropped after the step that reads it last, as in Python, so the replay's peak memory is the same.

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

enum Op : int {
  kEmpty = 0,
  kEmptyLike,
  kSlice0,
  kAlias,
  kDetach,
  kT,
  kView,
  kReshape,
  kTranspose,
  kContiguous,
  kToDtype,
  kNewEmpty,
  kMm,
  kAddmm,
  kLinear,
  kMatmul,
  kGroupedMm,
  kLaunch,
  kPython,
  kFreeStorage,
  kNumOps,
};

struct Descriptor {
  Py_ssize_t position;  // in the launch's argument tuple
  int slot;             // the tensor the descriptor is over
  py::dict maps;        // its address (int) -> its TMA map, shared with the Python replay
  py::object encode;    // encode(tensor) -> the map, kept in `maps`
};

struct Step {
  int op = kPython;
  std::vector<int> reads;
  std::vector<int64_t> ints;
  std::vector<int> release;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::Device(at::kCPU);
  // kLaunch
  py::object function;
  py::tuple arguments;
  std::vector<std::pair<Py_ssize_t, int>> tensors;  // (position in the arguments, slot)
  std::vector<Descriptor> descriptors;
  Py_ssize_t kernel_args_at = -1;  // Triton 3.7+: the kernel's arguments, from here on, go as one tuple
  // kPython
  py::object callback;  // callback(list of the tensors read, stream) -> the new tensors
};

at::ScalarType to_dtype(const py::handle& obj) {
  TORCH_CHECK(THPDtype_Check(obj.ptr()), "mok plan replay: expected a torch.dtype");
  return reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type;
}

at::Device to_device(const py::handle& obj) {
  TORCH_CHECK(THPDevice_Check(obj.ptr()), "mok plan replay: expected a torch.device");
  return reinterpret_cast<THPDevice*>(obj.ptr())->device;
}

class Plan {
 public:
  // steps: (op, reads, ints, extra, release) tuples (plan_cpp.py); extra: (dtype, device) for empty, dtype for
  // to(dtype), (function, arguments, [(position, slot)], [(position, slot, maps, encode)], kernel_args_at) for a
  // launch (kernel_args_at: -1, or where the arguments that go as one tuple start), the
  // callback for a Python step (its ints: [how many new tensors it returns]), else None. result: (slot, None)
  // or (-1, constant) per item of the flat tuple the replay returns.
  Plan(const py::list& steps, const py::list& result, int n_inputs) : n_inputs_(n_inputs) {
    int n_slots = n_inputs;
    for (const auto& item : steps) {
      auto t = item.cast<py::tuple>();
      Step s;
      s.op = t[0].cast<int>();
      TORCH_CHECK(s.op >= 0 && s.op < kNumOps, "mok plan replay: unknown step ", s.op);
      s.reads = t[1].cast<std::vector<int>>();
      s.ints = t[2].cast<std::vector<int64_t>>();
      s.release = t[4].cast<std::vector<int>>();
      for (int r : s.reads) TORCH_CHECK(r >= 0 && r < n_slots, "mok plan replay: a step reads slot ", r);
      py::object extra = t[3];
      switch (s.op) {
        case kEmpty: {
          auto e = extra.cast<py::tuple>();
          s.dtype = to_dtype(e[0]);
          s.device = to_device(e[1]);
          break;
        }
        case kToDtype:
          s.dtype = to_dtype(extra);
          break;
        case kSlice0:
          TORCH_CHECK(s.ints.size() == 4, "mok plan replay: a slice takes (has start, start, has end, end)");
          break;
        case kTranspose:
          TORCH_CHECK(s.ints.size() == 2, "mok plan replay: a transpose takes two dims");
          break;
        case kLaunch: {
          auto e = extra.cast<py::tuple>();
          s.function = e[0];
          s.arguments = e[1].cast<py::tuple>();
          for (const auto& pair : e[2].cast<py::list>()) {
            auto p = pair.cast<py::tuple>();
            s.tensors.emplace_back(p[0].cast<Py_ssize_t>(), p[1].cast<int>());
          }
          for (const auto& desc : e[3].cast<py::list>()) {
            auto d = desc.cast<py::tuple>();
            s.descriptors.push_back(
                Descriptor{d[0].cast<Py_ssize_t>(), d[1].cast<int>(), d[2].cast<py::dict>(), d[3]});
          }
          s.kernel_args_at = e[4].cast<Py_ssize_t>();
          TORCH_CHECK(s.kernel_args_at < static_cast<Py_ssize_t>(s.arguments.size()),
                      "mok plan replay: the kernel's arguments start past the launch's");
          break;
        }
        case kPython:
          s.callback = extra;
          break;
        case kFreeStorage:
          TORCH_CHECK(s.reads.size() == 1, "mok plan replay: free_storage reads one tensor");
          break;
        default:
          break;
      }
      n_slots += produces(s);
      steps_.push_back(std::move(s));
    }
    for (const auto& item : result) {
      auto t = item.cast<py::tuple>();
      result_.emplace_back(t[0].cast<int>(), py::reinterpret_borrow<py::object>(t[1]));
    }
    n_slots_ = n_slots;
  }

  py::tuple replay(const std::vector<std::optional<at::Tensor>>& inputs, int64_t stream) {
    TORCH_CHECK(static_cast<int>(inputs.size()) == n_inputs_, "mok plan replay: expected ", n_inputs_,
                " inputs, got ", inputs.size());
    std::vector<at::Tensor> slots;
    slots.reserve(n_slots_);
    for (const auto& t : inputs) slots.push_back(t.has_value() ? *t : at::Tensor());
    for (const Step& s : steps_) {
      run(s, slots, stream);
      for (int i : s.release) slots[i] = at::Tensor();
    }
    py::tuple out(result_.size());
    for (size_t i = 0; i < result_.size(); ++i) {
      const auto& [slot, constant] = result_[i];
      out[i] = slot >= 0 ? (slots[slot].defined() ? py::cast(slots[slot]) : py::none()) : constant;
    }
    return out;
  }

  int size() const { return static_cast<int>(steps_.size()); }

  std::vector<int> ops() const {
    std::vector<int> out;
    for (const Step& s : steps_) out.push_back(s.op);
    return out;
  }

 private:
  static int produces(const Step& s) {
    if (s.op == kLaunch || s.op == kFreeStorage) return 0;
    return s.op == kPython ? static_cast<int>(s.ints.at(0)) : 1;  // (a Python step: ints = [its new tensors])
  }

  static void run(const Step& s, std::vector<at::Tensor>& slots, int64_t stream) {
    auto in = [&](size_t i) -> const at::Tensor& { return slots[s.reads[i]]; };
    auto maybe = [&](size_t i) -> std::optional<at::Tensor> {
      return i < s.reads.size() ? std::optional<at::Tensor>(in(i)) : std::nullopt;
    };
    switch (s.op) {
      case kEmpty:
        slots.push_back(at::empty(s.ints, at::TensorOptions().dtype(s.dtype).device(s.device)));
        break;
      case kEmptyLike:
        slots.push_back(at::empty_like(in(0)));
        break;
      case kSlice0:
        slots.push_back(at::slice(in(0), 0, s.ints[0] ? std::optional<int64_t>(s.ints[1]) : std::nullopt,
                                  s.ints[2] ? std::optional<int64_t>(s.ints[3]) : std::nullopt, 1));
        break;
      case kAlias:
        slots.push_back(in(0));
        break;
      case kDetach:
        slots.push_back(in(0).detach());
        break;
      case kT:
        slots.push_back(in(0).t());
        break;
      case kView:
        slots.push_back(in(0).view(s.ints));
        break;
      case kReshape:
        slots.push_back(in(0).reshape(s.ints));
        break;
      case kTranspose:
        slots.push_back(in(0).transpose(s.ints[0], s.ints[1]));
        break;
      case kContiguous:
        slots.push_back(in(0).contiguous());
        break;
      case kToDtype:
        slots.push_back(in(0).to(s.dtype));
        break;
      case kNewEmpty:
        slots.push_back(in(0).new_empty(s.ints));
        break;
      case kMm:
        slots.push_back(at::mm(in(0), in(1)));
        break;
      case kAddmm:
        slots.push_back(at::addmm(in(0), in(1), in(2)));
        break;
      case kLinear:
        slots.push_back(at::linear(in(0), in(1), maybe(2)));
        break;
      case kMatmul:
        slots.push_back(at::matmul(in(0), in(1)));
        break;
      case kGroupedMm:
        slots.push_back(at::_grouped_mm(in(0), in(1), maybe(2), maybe(3), std::nullopt));
        break;
      case kLaunch:
        launch(s, slots, stream);
        break;
      case kPython: {
        py::list read(s.reads.size());
        for (size_t i = 0; i < s.reads.size(); ++i) {
          read[i] = in(i).defined() ? py::cast(in(i)) : py::none();
        }
        py::object made = s.callback(read, stream);
        size_t before = slots.size();
        for (const auto& t : made) slots.push_back(t.cast<at::Tensor>());
        TORCH_CHECK(slots.size() - before == static_cast<size_t>(s.ints.at(0)), "mok plan replay: a Python step ",
                    "returned ", slots.size() - before, " new tensors, expected ", s.ints.at(0));
        break;
      }
      case kFreeStorage:
        free_storage(in(0));
        break;
      default:
        TORCH_CHECK(false, "mok plan replay: unknown step ", s.op);
    }
  }

  // What `untyped_storage().resize_(0)` does on CUDA (at::native::resize_bytes_cuda): the data pointer dropped (its
  // memory back to the caching allocator, on the stream it was allocated on) and the size set to 0 bytes.
  static void free_storage(const at::Tensor& t) {
    TORCH_CHECK(t.defined(), "mok plan replay: no tensor to free the storage of");
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    TORCH_CHECK(storage->resizable(), "mok plan replay: Trying to resize storage that is not resizable");
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
    storage->set_nbytes(0);
  }

  static void launch(const Step& s, std::vector<at::Tensor>& slots, int64_t stream) {
    const Py_ssize_t n = PyTuple_GET_SIZE(s.arguments.ptr());
    py::tuple args(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* v = PyTuple_GET_ITEM(s.arguments.ptr(), i);
      Py_INCREF(v);
      PyTuple_SET_ITEM(args.ptr(), i, v);
    }
    auto put = [&](Py_ssize_t i, py::object v) {  // (a new tuple: its items are replaced, not shared)
      PyObject* old = PyTuple_GET_ITEM(args.ptr(), i);
      PyTuple_SET_ITEM(args.ptr(), i, v.release().ptr());
      Py_XDECREF(old);
    };
    put(3, py::int_(stream));
    for (const auto& [position, slot] : s.tensors) {
      const at::Tensor& t = slots[slot];
      // An address as an int: what Triton's launcher reads of a tensor (`data_ptr()`); None stays None.
      put(position, t.defined() ? py::object(py::int_(reinterpret_cast<uintptr_t>(t.data_ptr())))
                                : py::object(py::none()));
    }
    for (const auto& d : s.descriptors) {
      const at::Tensor& base = slots[d.slot];
      py::int_ key(reinterpret_cast<uintptr_t>(base.data_ptr()));
      PyObject* map = PyDict_GetItem(d.maps.ptr(), key.ptr());  // borrowed
      put(d.position, map != nullptr ? py::reinterpret_borrow<py::object>(map) : d.encode(base));
    }
    if (s.kernel_args_at >= 0) {  // (lead..., (kernel arguments...))
      py::tuple kernel_args = py::reinterpret_steal<py::tuple>(PyTuple_GetSlice(args.ptr(), s.kernel_args_at, n));
      py::tuple lead = py::reinterpret_steal<py::tuple>(PyTuple_GetSlice(args.ptr(), 0, s.kernel_args_at));
      if (!kernel_args || !lead) throw py::error_already_set();
      args = py::reinterpret_steal<py::tuple>(PySequence_Concat(lead.ptr(), py::make_tuple(kernel_args).ptr()));
      if (!args) throw py::error_already_set();
    }
    PyObject* done = PyObject_Call(s.function.ptr(), args.ptr(), nullptr);
    if (done == nullptr) throw py::error_already_set();
    Py_DECREF(done);
  }

  int n_inputs_;
  int n_slots_ = 0;
  std::vector<Step> steps_;
  std::vector<std::pair<int, py::object>> result_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mok_compile: a launch plan's replay in C++ (mok_compile/kernels/plan_cpp.py)";
  py::class_<Plan>(m, "Plan")
      .def(py::init<const py::list&, const py::list&, int>())
      .def("replay", &Plan::replay)
      .def("__len__", &Plan::size)
      .def_property_readonly("ops", &Plan::ops);  // each step's index in OPS
  m.attr("OPS") = py::make_tuple("empty", "empty_like", "slice0", "alias", "detach", "t", "view", "reshape",
                                 "transpose", "contiguous", "to_dtype", "new_empty", "mm", "addmm", "linear",
                                 "matmul", "grouped_mm", "launch", "python", "free_storage");
}
