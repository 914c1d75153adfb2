// Expert weight gradients of the fused MoE op on Hopper (sm_90a): C[e] = P[rows of e]^T @ Q[rows of e] for every
// expert e, the sum running over e's rows in expert-sorted order. P and Q rows are either the sorted rows
// themselves or, gathered, the rows of the token each sorted row belongs to (sorted_pair[r] / top_k), so
//   dW1[e] = dh[rows of e]^T @ x[tokens of e]        (P = dh sorted, Q = x gathered)
//   dW2[e] = go[tokens of e]^T @ (w * act)[rows of e] (P = grad_out gathered, Q = act_w sorted)
// run straight from the unsorted x and grad_out, without the sorted copies PyTorch's grouped GEMM needs.
//
// Why: on CUTLASS the two weight gradients and their row gathers take about a third of the Qwen3 layer's backward
// (benchmarks/NOTES-gpu.md v16 (3)), and each output tile there reduces few rows (~256 at T=4096) and writes 64 KB of
// bf16. This kernel gathers the rows itself, is persistent, and stores each tile by TMA while its warps go on.
// Measured (NOTES v29): every output bit for bit CUTLASS's, but slower: 0.41-0.78x CUTLASS plus its gathers alone,
// 0.79-0.84x for the layer's fwd+bwd. Its loads limit it: without its MMAs it ran 0.578 against 0.594 ms (Qwen3 dW1,
// T=4096, sorted x), and gathering x rows by cp.async took 1.8x the time of TMA boxes over sorted rows. So it runs
// only on request (MOK_GEMM_ENGINE=wgrad=sm90), as the base for sharing the common operand between two CTAs by
// TMA multicast and deeper pipelines.
//
// One CTA per SM (384 threads), persistent over the output tiles (expert, 128 rows of C, 256 columns of C):
//   warp group 0     producer: per K step (64 sorted rows), the 64 x 128 slice of P and the 64 x 256 slice of Q as
//                    64-column panels in the 128-byte swizzle: a sorted operand by TMA boxes, a gathered one (and
//                    the sorted one in an expert's last, partial step) row by row with cp.async, 16 bytes per lane,
//                    rows past the expert's end and columns past P or Q zero filled
//   warp groups 1-2  consumers: rows [0, 64) and [64, 128) of the C tile, four wgmma m64n256k16 per K step with
//                    both operands MN-major (P's rows run along C's rows, Q's along its columns); then the tile
//                    goes to shared memory as bf16 and out by TMA stores (a 3-d map [E, P, Q] clips the edges)
// 48 KB per stage, 3 stages, full/empty mbarriers; 64 KB of epilogue buffer. An expert without rows gets zeros.
// Deterministic: every output element is one fp32 sum over the expert's rows in sorted order.
#include "sm90_common.cuh"

namespace mok_sm90 {
namespace wgrad {

constexpr int BM = 128;                           // rows of C per tile (P's columns)
constexpr int BN = 256;                           // columns of C per tile (Q's columns)
constexpr int BK = 64;                            // sorted rows per stage
constexpr int STAGES = 3;
constexpr int THREADS = 384;
constexpr int PANEL_BYTES = BK * 128;             // 64 rows x 64 columns of bf16, one swizzled panel: 8 KB
constexpr int A_BYTES = (BM / 64) * PANEL_BYTES;  // 16 KB
constexpr int B_BYTES = (BN / 64) * PANEL_BYTES;  // 32 KB
constexpr int EPI_BYTES = BM * BN * 2;            // each consumer's 64 x 256 bf16 result as four 64 x 64 panels
constexpr int SMEM_BYTES = STAGES * (A_BYTES + B_BYTES) + EPI_BYTES + 1024 /* alignment */ + 2 * STAGES * 8;

struct Params {
  const __nv_bfloat16* p;   // [sorted rows or tokens, P]
  const __nv_bfloat16* q;   // [sorted rows or tokens, Q]
  const int* sorted_pair;   // [T*K] pair id (token * K + slot) at each sorted row
  const int* expert_count;  // [E]
  const int* expert_start;  // [E]
  unsigned long long top_k_magic;  // ceil(2^40 / top_k): token = (pair * top_k_magic) >> 40
  int P, Q, E, num_m, num_n, p_gather, q_gather;
};

__device__ __forceinline__ void named_barrier(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int col, int row, int expert) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(expert), "r"(src)
               : "memory");
}

struct Tile {
  int expert, m0, n0, row0, rows;
};

// Tile t: experts in order (their rows stay in L2 while all their tiles run), then C's row blocks, then columns.
// Its expert's rows come from a `TileRows` loaded one tile ahead, so that no warp waits on a global load at the
// start of a tile.
struct TileRows {
  int row0, rows;
  __device__ __forceinline__ void load(const Params& p, int t, int num_tiles) {
    if (t < num_tiles) {
      const int e = t / (p.num_m * p.num_n);
      row0 = p.expert_start[e];
      rows = p.expert_count[e];
    }
  }
};

__device__ __forceinline__ Tile tile_at(const Params& p, int t, const TileRows& r) {
  Tile tile;
  const int per_expert = p.num_m * p.num_n, rest = t % per_expert;
  tile.expert = t / per_expert;
  tile.m0 = (rest % p.num_m) * BM;
  tile.n0 = (rest / p.num_m) * BN;
  tile.row0 = r.row0;
  tile.rows = r.rows;
  return tile;
}

// One operand slice of a K step as this producer thread sees it: CHUNKS 16-byte chunks per row (the slice's width
// / 8), so 128 / CHUNKS rows per pass of the 128 threads and PASSES passes over the 64 rows. `rows` first loads the
// sorted rows' pair ids where the operand is gathered (before the producer waits for a free stage, so the loads'
// latency passes meanwhile); `copy` then issues the cp.async copies into 64-column panels in the 128-byte swizzle.
template <int CHUNKS, int PASSES>
struct Slice {
  static constexpr int ROWS_PER_PASS = 128 / CHUNKS;
  int row[PASSES];  // sorted row (or its pair id, gathered); -1 past the expert's end

  __device__ __forceinline__ void rows(const Tile& tile, int k0, const int* sorted_pair, bool gather) {
    const int row_sub = threadIdx.x / CHUNKS;
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const int r = k0 + row_sub + ROWS_PER_PASS * i;
      row[i] = r >= tile.rows ? -1 : gather ? __ldg(sorted_pair + tile.row0 + r) : tile.row0 + r;
    }
  }

  // pair / top_k as (pair * magic) >> 40, magic = ceil(2^40 / top_k): exact for every pair id below 2^32.
  __device__ __forceinline__ void copy(uint32_t dst, const __nv_bfloat16* src, int width, int col0, bool gather,
                                       unsigned long long magic) const {
    const int chunk = threadIdx.x % CHUNKS, row_sub = threadIdx.x / CHUNKS;
    const int col = col0 + chunk * 8;
    const bool in_cols = col < width;  // width % 8 == 0: a chunk is all in or all out
    const uint32_t panel = dst + (chunk / 8) * PANEL_BYTES;
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const bool load = in_cols && row[i] >= 0;
      const long long src_row = gather ? static_cast<long long>((static_cast<unsigned long long>(row[i]) * magic) >> 40)
                                       : row[i];
      cp_async_16(panel + swizzle_128b(row_sub + ROWS_PER_PASS * i, chunk % 8),
                  load ? src + src_row * width + col : src, load ? 16u : 0u);
    }
  }
};

__global__ void __launch_bounds__(THREADS, 1) wgrad_kernel(const __grid_constant__ CUtensorMap out_map,
                                                           const __grid_constant__ CUtensorMap p_map,
                                                           const __grid_constant__ CUtensorMap q_map,
                                                           const Params p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;  // the 128-byte swizzle repeats every 1 KB
  const uint32_t a_smem = base, b_smem = a_smem + STAGES * A_BYTES, epi_smem = b_smem + STAGES * B_BYTES;
  const uint32_t full_bar = epi_smem + EPI_BYTES, empty_bar = full_bar + STAGES * 8;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, 128 + 1);  // the producer's 128 cp.async arrivals + thread 0's expect_tx
      mbar_init(empty_bar + 8 * s, 8);       // lane 0 of each of the 8 consumer warps
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int num_tiles = p.E * p.num_m * p.num_n;

  if (threadIdx.x < 128) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 72;");
    int it = 0;  // K steps issued so far over all tiles: stage it % STAGES, phase (it / STAGES) & 1
    TileRows next;
    next.load(p, blockIdx.x, num_tiles);
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const Tile tile = tile_at(p, t, next);
      next.load(p, t + gridDim.x, num_tiles);
      for (int k0 = 0; k0 < tile.rows; k0 += BK, ++it) {
        const int s = it % STAGES;
        Slice<BM / 8, BK * BM / 8 / 128> a;
        Slice<BN / 8, BK * BN / 8 / 128> b;
        // A sorted operand comes by TMA boxes (64 rows x 64 columns) while all 64 rows are the expert's; in the
        // last, partial step its rows past the end would be the next expert's, so they come by cp.async, zeros.
        const bool whole = k0 + BK <= tile.rows;
        const bool a_tma = whole && !p.p_gather, b_tma = whole && !p.q_gather;
        if (!a_tma) a.rows(tile, k0, p.sorted_pair, p.p_gather);
        if (!b_tma) b.rows(tile, k0, p.sorted_pair, p.q_gather);
        mbar_wait(empty_bar + 8 * s, ((it / STAGES) & 1) ^ 1);
        const uint32_t a_s = a_smem + s * A_BYTES, b_s = b_smem + s * B_BYTES, full = full_bar + 8 * s;
        if (threadIdx.x == 0) {
          mbar_expect_tx(full, (a_tma ? A_BYTES : 0) + (b_tma ? B_BYTES : 0));
          for (int i = 0; a_tma && i < BM / 64; ++i)
            tma_load(a_s + i * PANEL_BYTES, &p_map, tile.m0 + 64 * i, tile.row0 + k0, full);
          for (int i = 0; b_tma && i < BN / 64; ++i)
            tma_load(b_s + i * PANEL_BYTES, &q_map, tile.n0 + 64 * i, tile.row0 + k0, full);
        }
        if (!a_tma) a.copy(a_s, p.p, p.P, tile.m0, p.p_gather, p.top_k_magic);
        if (!b_tma) b.copy(b_s, p.q, p.Q, tile.n0, p.q_gather, p.top_k_magic);
        cp_async_arrive(full_bar + 8 * s);
      }
    }
  } else {  // consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
    const int consumer = threadIdx.x / 128 - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const bool leader = threadIdx.x % 128 == 0;
    const uint32_t epi = epi_smem + consumer * (EPI_BYTES / 2);
    int it = 0;
    TileRows next;
    next.load(p, blockIdx.x, num_tiles);
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const Tile tile = tile_at(p, t, next);
      next.load(p, t + gridDim.x, num_tiles);
      const int num_k = (tile.rows + BK - 1) / BK;
      float acc[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      for (int k = 0; k < num_k; ++k, ++it) {
        const int s = it % STAGES;
        mbar_wait(full_bar + 8 * s, (it / STAGES) & 1);
        const uint32_t a_s = a_smem + s * A_BYTES + consumer * PANEL_BYTES, b_s = b_smem + s * B_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {  // 16 rows of 128 bytes: 2 KB per step down the panels
          wgmma_m64n256k16<1, 1>(acc, smem_desc(a_s + kk * 2048, PANEL_BYTES),
                                 smem_desc(b_s + kk * 2048, PANEL_BYTES));
        }
        wgmma_commit();
        wgmma_wait<1>();  // the previous K step's wgmmas are done: hand its stage back
        if (k > 0 && lane == 0) mbar_arrive(empty_bar + 8 * ((it - 1) % STAGES));
      }
      wgmma_wait<0>();
      if (num_k > 0 && lane == 0) mbar_arrive(empty_bar + 8 * ((it - 1) % STAGES));
      fence_accumulators(acc);

      // The previous tile's stores have read the buffer before anyone writes it again.
      if (leader) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      named_barrier(1 + consumer);
      // Thread holds rows r and r + 8 of its 64, columns 8j + 2(lane % 4) + {0, 1}: panel j / 8, chunk j % 8.
      const int r_top = warp * 16 + lane / 4;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = r_top + 8 * half;
          const __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
          const uint32_t dst = epi + (j / 8) * PANEL_BYTES + swizzle_128b(r, j % 8) + 4 * (lane % 4);
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(dst), "r"(*reinterpret_cast<const uint32_t*>(&v)) : "memory");
        }
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the TMA unit
      named_barrier(1 + consumer);
      const int row = tile.m0 + consumer * 64;
      if (leader && row < p.P) {
        for (int panel = 0; panel < BN / 64 && tile.n0 + panel * 64 < p.Q; ++panel)
          tma_store(&out_map, epi + panel * PANEL_BYTES, tile.n0 + panel * 64, row, tile.expert);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    }
    if (leader) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stores done before the CTA exits
  }
}

}  // namespace wgrad
}  // namespace mok_sm90

// out[e] = P[rows of e]^T @ Q[rows of e] (bf16 [E, P, Q], fp32 sums in sorted row order) over `sorted_rows` = T*K
// sorted rows; P and Q rows by token (sorted_pair / top_k) where p_gather / q_gather, else [sorted_rows, P or Q].
// One CTA per SM; the host never reads the routing.
extern "C" int mok_wgrad_sm90(const void* p, const void* q, const int* sorted_pair, const int* expert_count,
                              const int* expert_start, void* out, int sorted_rows, int P, int Q, int E, int top_k,
                              int p_gather, int q_gather, void* stream, char* err, int err_len) {
  using namespace mok_sm90::wgrad;
  using namespace mok_sm90_host;
  if (E == 0 || P == 0 || Q == 0) return 0;
  if (top_k < 1 || top_k > 256) return fail(err, err_len, "top_k must be in [1, 256]", 0);
  if (encode_tiled() == nullptr) return fail(err, err_len, "the CUDA driver has no cuTensorMapEncodeTiled", 0);
  CUtensorMap map{}, p_map{}, q_map{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(Q), static_cast<cuuint64_t>(P), static_cast<cuuint64_t>(E)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(Q) * 2, static_cast<cuuint64_t>(P) * Q * 2};
  const cuuint32_t box[3] = {64, 64, 1};
  CUresult res = encode_bf16(&map, out, 3, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_NONE);
  // The sorted operands' rows ([T*K, width], boxes of 64 rows x 64 columns, zeros past the edges).
  for (int side = 0; side < 2 && res == CUDA_SUCCESS; ++side) {
    if ((side == 0 ? p_gather : q_gather) || sorted_rows == 0) continue;  // not read by TMA
    const int width = side == 0 ? P : Q;
    const cuuint64_t op_dims[2] = {static_cast<cuuint64_t>(width), static_cast<cuuint64_t>(sorted_rows)};
    const cuuint64_t op_strides[1] = {static_cast<cuuint64_t>(width) * 2};
    res = encode_bf16(side == 0 ? &p_map : &q_map, side == 0 ? p : q, 2, op_dims, op_strides, box,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  }
  if (res != CUDA_SUCCESS) return fail(err, err_len, "cuTensorMapEncodeTiled failed", static_cast<int>(res));

  static int sm_cache[64] = {};
  int sms = 0;
  if (const int code = sm_count(wgrad_kernel, SMEM_BYTES, sm_cache, sms, err, err_len)) return code;

  Params params{};
  params.p = static_cast<const __nv_bfloat16*>(p);
  params.q = static_cast<const __nv_bfloat16*>(q);
  params.sorted_pair = sorted_pair;
  params.expert_count = expert_count;
  params.expert_start = expert_start;
  params.P = P;
  params.Q = Q;
  params.E = E;
  params.top_k_magic = ((1ull << 40) + top_k - 1) / top_k;
  params.num_m = (P + BM - 1) / BM;
  params.num_n = (Q + BN - 1) / BN;
  params.p_gather = p_gather;
  params.q_gather = q_gather;
  const long long tiles = static_cast<long long>(E) * params.num_m * params.num_n;
  const unsigned grid = static_cast<unsigned>(tiles < sms ? tiles : sms);
  wgrad_kernel<<<grid, THREADS, SMEM_BYTES, static_cast<cudaStream_t>(stream)>>>(map, p_map, q_map, params);
  return launch_status(err, err_len);
}
