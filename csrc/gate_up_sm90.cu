// Forward gate_up of the fused MoE op on Hopper (sm_90a): the grouped GEMM x[token] @ W1[e]^T over the
// expert-sorted (token, slot) pairs, with the token gather fused into the A loads and SiLU(gate) * up in the
// epilogue, for the layout most Hugging Face MoE blocks use (W1 [E, 2I, H], gate rows [0, I), up rows [I, 2I)).
//
// Why CUDA C++ next to the Triton gate_up: two things Triton 3.6 cannot build on Hopper. A persistent, warp-
// specialised schedule (its automatic warp specialisation hangs there: benchmarks/NOTES-gpu.md v27 (1)): a producer
// warp group keeps loading the next tile's K steps while the consumers finish a tile and run its epilogue. And TMA
// multicast: the two CTAs of a cluster take two row blocks of one expert and each loads half of their shared W1
// tile for both, a third fewer L2 reads per FLOP (the Triton gate_up is bound by L2 reads: NOTES v25, v27).
// Measured (NOTES v28): bit for bit the Triton kernel's output, 0.93-1.15x its speed alone, and no faster in the
// layer; so mok_compile runs it only on request (MOK_GEMM_ENGINE=gate_up=sm90).
//
// One CTA per SM (384 threads), clusters of 2, looping over cluster tiles (a pair of 128-row blocks x 128 output
// columns):
//   warp group 0     producer: gathers the 128 x 64 A tile of each K step with cp.async (8 lanes per 128-byte
//                    row, stored in the 128-byte swizzle wgmma reads) and loads the W1 tile (128 gate rows and
//                    the 128 matching up rows x 64 K) as two TMA boxes, one from each CTA of a same-expert pair
//   warp groups 1-2  consumers: rows [0, 64) and [64, 128) of the tile, one wgmma m64n256k16 per 16 of K
//                    (accumulator columns [0, 128) gate, [128, 256) up), then the epilogue
// 48 KB per stage (16 KB A + 32 KB W1), 4 stages, handed over through full/empty mbarriers; a stage is refilled once
// the consumers of both CTAs have freed it. Row blocks are 128 rows of one expert (its last block partly empty).
// Deterministic: every output element is one fp32 sum in K order.
#include "sm90_common.cuh"

namespace mok_sm90 {

constexpr int BM = 128;                      // rows per tile
constexpr int BN_HALF = 128;                 // output columns per tile (gate and up: 256 W1 rows)
constexpr int BK = 64;                       // K per stage: 128 bytes of bf16, one swizzle row
constexpr int STAGES = 4;
constexpr int THREADS = 384;
constexpr int MAX_EXPERTS = 256;             // the shared expert table's size
constexpr int GROUP = 8;                     // pairs walked together over the N tiles (L2 reuse of x rows, W1)
constexpr int A_BYTES = BM * BK * 2;         // 16 KB
constexpr int BOX_BYTES = BN_HALF * BK * 2;  // one TMA box: 128 W1 rows x 64 K, 16 KB
constexpr int B_BYTES = 2 * BOX_BYTES;
constexpr int SMEM_BYTES = STAGES * (A_BYTES + B_BYTES) + 1024 /* alignment */ + 2 * STAGES * 8;

struct Params {
  const __nv_bfloat16* x;      // [T, H]
  const int* sorted_pair;      // [T*K] pair id (token * K + slot) at each sorted row
  const int* expert_count;     // [E]
  const int* expert_start;     // [E]
  __nv_bfloat16* out;          // [T*K, I] act(gate) * up per sorted row
  __nv_bfloat16* h;            // [T*K, 2I] gate and up before the activation (training), or nullptr
  int H, I, E, top_k, num_n;
};

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrive on the barrier at the same shared-memory offset in CTA `rank` of the cluster (possibly this one).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// The box lands at offset `dst` of both CTAs of the cluster and signals each one's barrier at offset `bar`.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap* map, int k, int row,
                                                   uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(bar), "h"(static_cast<uint16_t>(3))
      : "memory");
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// HF's bf16 module: silu(gate) is rounded, then multiplied by up and rounded (activation.py's act_forward).
// (div.full and ex2.approx as Triton emits them, so both gate_up kernels round alike.)
__device__ __forceinline__ float silu_mul(float g, float u) {
  g = round_bf16(g);
  u = round_bf16(u);
  float sigmoid;
  asm("div.full.f32 %0, %1, %2;" : "=f"(sigmoid) : "f"(1.0f), "f"(1.0f + __expf(-g)));
  return round_bf16(g * sigmoid) * u;
}


// Per expert, in shared memory (built once per CTA by warp 0): its first sorted row and row count, and where its
// row blocks fall among the clusters' work. An expert's blocks go in pairs (2j, 2j + 1), one pair per cluster
// tile; an odd block out is paired with the next expert's odd block out.
struct ExpertTable {
  int first_pair[MAX_EXPERTS + 1];  // same-expert pairs before expert e; [E] = all of them
  int first_odd[MAX_EXPERTS + 1];   // odd blocks out before expert e; [E] = all of them
  int row_start[MAX_EXPERTS];
  int count[MAX_EXPERTS];
};

__device__ void build_expert_table(const Params& p, ExpertTable& tab) {
  const int lane = threadIdx.x % 32, per = (p.E + 31) / 32;
  const int first = min(lane * per, p.E), end = min(first + per, p.E);
  int pairs = 0, odd = 0;
  for (int e = first; e < end; ++e) {
    const int blocks = (p.expert_count[e] + BM - 1) / BM;
    pairs += blocks / 2;
    odd += blocks % 2;
  }
  int pairs_incl = pairs, odd_incl = odd;
  for (int d = 1; d < 32; d *= 2) {
    const int a = __shfl_up_sync(0xffffffffu, pairs_incl, d), b = __shfl_up_sync(0xffffffffu, odd_incl, d);
    if (lane >= d) {
      pairs_incl += a;
      odd_incl += b;
    }
  }
  pairs = pairs_incl - pairs;
  odd = odd_incl - odd;
  for (int e = first; e < end; ++e) {
    const int count = p.expert_count[e], blocks = (count + BM - 1) / BM;
    tab.first_pair[e] = pairs;
    tab.first_odd[e] = odd;
    tab.row_start[e] = p.expert_start[e];
    tab.count[e] = count;
    pairs += blocks / 2;
    odd += blocks % 2;
  }
  if (lane == 31) {
    tab.first_pair[p.E] = pairs_incl;
    tab.first_odd[p.E] = odd_incl;
  }
}

// The last expert e < E with first[e] <= i: the one holding item i (experts without items share their successor's
// first index, so the last of a run of equals is the one that has it).
__device__ __forceinline__ int expert_of(const int* first, int E, int i) {
  int lo = 0, hi = E;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first[mid] <= i) lo = mid; else hi = mid;
  }
  return lo;
}

enum Mode : int { kMulticast, kAlone, kIdle };

struct Tile {
  int mode, expert, row0, row_end, n0;
};

// Cluster tiles per N tile: the same-expert pairs, then the odd blocks out two at a time.
__device__ __forceinline__ int num_pairs(const ExpertTable& tab, int E) {
  return tab.first_pair[E] + (tab.first_odd[E] + 1) / 2;
}

// This CTA's share of cluster tile t: pair (GROUP pairs at a time, pair fastest; grouped_gemm.py's _tile_of)
// and N tile. kMulticast: rank r takes block 2j + r of one expert, and both share its W1 tiles. kAlone: an odd
// block out, loading its own W1 tiles. kIdle: no block (the last odd pair's rank 1): it runs the K steps on zero
// rows and stores nothing, so both ranks stay at the same pipeline stage.
__device__ Tile tile_at(const ExpertTable& tab, int E, int t, int num_n, int rank) {
  const int total_pairs = tab.first_pair[E], total_odd = tab.first_odd[E];
  const int per_group = GROUP * num_n;
  const int first = (t / per_group) * GROUP;
  const int size = min(num_pairs(tab, E) - first, GROUP);
  const int pair = first + (t % per_group) % size;
  Tile tile;
  tile.n0 = ((t % per_group) / size) * BN_HALF;
  int block;
  if (pair < total_pairs) {
    tile.mode = kMulticast;
    tile.expert = expert_of(tab.first_pair, E, pair);
    block = 2 * (pair - tab.first_pair[tile.expert]) + rank;
  } else {
    const int odd = 2 * (pair - total_pairs) + rank;
    tile.mode = odd < total_odd ? kAlone : kIdle;
    tile.expert = expert_of(tab.first_odd, E, min(odd, total_odd - 1));
    block = (tab.count[tile.expert] + BM - 1) / BM - 1;
  }
  tile.row0 = tab.row_start[tile.expert] + block * BM;
  tile.row_end = tile.mode == kIdle ? tile.row0 : min(tab.row_start[tile.expert] + tab.count[tile.expert],
                                                      tile.row0 + BM);
  return tile;
}

__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS, 1)
    gate_up_kernel(const __grid_constant__ CUtensorMap w1_map, const Params p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ ExpertTable tab;
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;  // the 128-byte swizzle repeats every 1 KB
  const uint32_t a_smem = base, b_smem = base + STAGES * A_BYTES;
  const uint32_t full_bar = b_smem + STAGES * B_BYTES, empty_bar = full_bar + STAGES * 8;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, 128 + 1);  // the producer's 128 cp.async arrivals + the TMA expect_tx
      mbar_init(empty_bar + 8 * s, 16);      // lane 0 of each of the 8 consumer warps, of both CTAs
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < 32) build_expert_table(p, tab);
  __syncthreads();
  cluster_sync();  // the partner's barriers exist before any multicast load or remote arrive
  const int rank = static_cast<int>(cluster_rank());
  const int cluster = blockIdx.x / 2, num_clusters = gridDim.x / 2;
  const int num_tiles = num_pairs(tab, p.E) * p.num_n;
  const int num_k = (p.H + BK - 1) / BK;
  const int lane = threadIdx.x % 32;

  if (threadIdx.x < 128) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    const int chunk = threadIdx.x % 8, row_sub = threadIdx.x / 8;  // this thread's 16 bytes of rows row_sub + 16i
    int it = 0;  // K steps issued so far over all tiles: stage it % STAGES, phase (it / STAGES) & 1
    for (int t = cluster; t < num_tiles; t += num_clusters) {
      const Tile tile = tile_at(tab, p.E, t, p.num_n, rank);
      int token[8];  // -1: a row past the expert's end (zero filled)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int row = tile.row0 + row_sub + 16 * i;
        token[i] = row < tile.row_end ? p.sorted_pair[row] / p.top_k : -1;
      }
      const int w1_row = tile.expert * 2 * p.I + tile.n0;
      for (int k = 0; k < num_k; ++k, ++it) {
        const int s = it % STAGES;
        mbar_wait(empty_bar + 8 * s, ((it / STAGES) & 1) ^ 1);
        const uint32_t a_s = a_smem + s * A_BYTES, b_s = b_smem + s * B_BYTES, full = full_bar + 8 * s;
        const int k0 = k * BK;
        if (threadIdx.x == 0) {
          mbar_expect_tx(full, B_BYTES);
          if (tile.mode == kMulticast) {  // rank 0 brings the gate rows, rank 1 the up rows, each to both CTAs
            tma_load_multicast(b_s + rank * BOX_BYTES, &w1_map, k0, w1_row + rank * p.I, full);
          } else {
            tma_load(b_s, &w1_map, k0, w1_row, full);                  // gate rows
            tma_load(b_s + BOX_BYTES, &w1_map, k0, w1_row + p.I, full);  // the matching up rows
          }
        }
        const int col = k0 + chunk * 8;
        const bool in_k = col < p.H;  // H % 8 == 0: a chunk is all in or all out
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = row_sub + 16 * i;
          const bool load = in_k && token[i] >= 0;
          cp_async_16(a_s + swizzle_128b(r, chunk),
                      load ? p.x + static_cast<long long>(token[i]) * p.H + col : p.x, load ? 16u : 0u);  // 0: zeros
        }
        cp_async_arrive(full);
      }
    }
  } else {  // consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
    const int consumer = threadIdx.x / 128 - 1, warp = (threadIdx.x % 128) / 32;
    int it = 0;
    for (int t = cluster; t < num_tiles; t += num_clusters) {
      const Tile tile = tile_at(tab, p.E, t, p.num_n, rank);
      float acc[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      for (int k = 0; k < num_k; ++k, ++it) {
        const int s = it % STAGES;
        mbar_wait(full_bar + 8 * s, (it / STAGES) & 1);
        const uint32_t a_s = a_smem + s * A_BYTES + consumer * 64 * 128, b_s = b_smem + s * B_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          wgmma_m64n256k16<0, 0>(acc, smem_desc(a_s + kk * 32), smem_desc(b_s + kk * 32));
        wgmma_commit();
        wgmma_wait<1>();  // the previous K step's wgmmas are done: hand its stage back
        // A stage may hold the partner's multicast W1 half: free it on both CTAs (lane r tells CTA r).
        if (k > 0 && lane < 2) mbar_arrive_cluster(empty_bar + 8 * ((it - 1) % STAGES), lane);
      }
      wgmma_wait<0>();
      if (lane < 2) mbar_arrive_cluster(empty_bar + 8 * ((it - 1) % STAGES), lane);  // the tile's last stage
      fence_accumulators(acc);

      // Thread holds rows r and r + 8, columns n0 + 8j + 2(lane % 4) + {0, 1}; gate in acc[4j..], up 64 registers
      // later (accumulator columns + 128).
      const int r_top = consumer * 64 + warp * 16 + lane / 4;
      const int rows = tile.row_end - tile.row0;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = tile.n0 + 8 * j + 2 * (lane % 4);
        if (col >= p.I) continue;  // I % 8 == 0: col + 1 < I too
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = r_top + 8 * half;
          if (r >= rows) continue;
          const long long row = tile.row0 + r;
          const float g0 = acc[4 * j + 2 * half], g1 = acc[4 * j + 2 * half + 1];
          const float u0 = acc[64 + 4 * j + 2 * half], u1 = acc[64 + 4 * j + 2 * half + 1];
          if (p.h != nullptr) {
            __nv_bfloat16* hrow = p.h + row * 2 * p.I;
            *reinterpret_cast<__nv_bfloat162*>(hrow + col) = __floats2bfloat162_rn(g0, g1);
            *reinterpret_cast<__nv_bfloat162*>(hrow + p.I + col) = __floats2bfloat162_rn(u0, u1);
          }
          *reinterpret_cast<__nv_bfloat162*>(p.out + row * p.I + col) =
              __floats2bfloat162_rn(silu_mul(g0, u0), silu_mul(g1, u1));
        }
      }
    }
  }
  cluster_sync();  // neither CTA leaves while its partner may still signal its barriers
}

}  // namespace mok_sm90

// ----------------------------------------------------------------------------------------------- host side
// A C entry point, called through ctypes (mok_compile/kernels/gate_up_sm90.py checks the tensors first): no torch
// headers, so the build takes seconds. Returns 0, or a CUDA error code with its text in `err`.
// out[r] = silu(x[t_r] @ W1[e_r][:I]^T) * (x[t_r] @ W1[e_r][I:]^T) for each of the `rows` sorted rows; h (or null)
// gets the two products before the activation. One CTA per SM, whatever the routing (the host never reads it).
extern "C" int mok_gate_up_sm90(const void* x, const int* sorted_pair, const void* w1, const int* expert_count,
                                const int* expert_start, void* out, void* h, int rows, int H, int I, int E,
                                int top_k, void* stream, char* err, int err_len) {
  using namespace mok_sm90;
  using namespace mok_sm90_host;
  if (rows == 0) return 0;
  if (E > MAX_EXPERTS) return fail(err, err_len, "more than 256 experts", 0);
  if (encode_tiled() == nullptr) return fail(err, err_len, "the CUDA driver has no cuTensorMapEncodeTiled", 0);
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(H), static_cast<cuuint64_t>(E) * 2 * I};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(H) * 2};
  const cuuint32_t box[2] = {BK, BN_HALF};
  const CUresult res = encode_bf16(&map, w1, 2, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  if (res != CUDA_SUCCESS) return fail(err, err_len, "cuTensorMapEncodeTiled failed", static_cast<int>(res));

  static int sm_cache[64] = {};
  int sms = 0;
  if (const int code = sm_count(gate_up_kernel, SMEM_BYTES, sm_cache, sms, err, err_len)) return code;

  Params params{};
  params.x = static_cast<const __nv_bfloat16*>(x);
  params.sorted_pair = sorted_pair;
  params.expert_count = expert_count;
  params.expert_start = expert_start;
  params.out = static_cast<__nv_bfloat16*>(out);
  params.h = static_cast<__nv_bfloat16*>(h);
  params.H = H;
  params.I = I;
  params.E = E;
  params.top_k = top_k;
  params.num_n = (I + BN_HALF - 1) / BN_HALF;
  // At most one partial block per expert: an upper bound on the cluster tiles, for small problems' grids.
  const long long max_blocks = static_cast<long long>(rows + BM - 1) / BM + (E < rows ? E : rows);
  const long long max_tiles = (max_blocks + 1) / 2 * params.num_n;
  const unsigned grid = 2 * static_cast<unsigned>(max_tiles < sms / 2 ? max_tiles : sms / 2);
  gate_up_kernel<<<grid, THREADS, SMEM_BYTES, static_cast<cudaStream_t>(stream)>>>(map, params);
  return launch_status(err, err_len);
}
