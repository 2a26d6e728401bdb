
#include <ptxtrain/ptx.cuh>
#include <ptxtrain/comm.cuh>
using namespace ptxtrain;

// Polls flags[0..n) until each is >= target (threads share the list), then an acquiring fence
// and a block barrier. On timeout, records `code` in *error and stops waiting.
__device__ __forceinline__ void wait_flags(const int* flags, int n, int target,
                                           long long timeout, int* error, int code) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long start = clock64_ptx();
    while (ld_relaxed_sys(flags + i) < target) {
      if (clock64_ptx() - start > timeout) {
        atomicExch(error, code);
        break;
      }
    }
  }
  fence_acq_rel_sys();
  __syncthreads();
}

// Tuning knobs (compile-time, see compile_kernel): threads per block and 16-byte loads in flight
// per lane of a row copy.
#ifndef PTXTRAIN_NVL_THREADS
#define PTXTRAIN_NVL_THREADS 512
#endif
#ifndef PTXTRAIN_NVL_UNROLL
#define PTXTRAIN_NVL_UNROLL 4
#endif
#ifndef PTXTRAIN_NVL_PIPELINE  // 1: per-block flags, copy-out overlaps other blocks' sends;
#define PTXTRAIN_NVL_PIPELINE 0  // 2: sender and receiver blocks, per-round progress flags
#endif
#ifndef PTXTRAIN_NVL_ROUND_ROWS  // (2) rows per sender warp between two progress releases
#define PTXTRAIN_NVL_ROUND_ROWS 2
#endif
#ifndef PTXTRAIN_NVL_COMBINE  // (2) 1: receivers sum each token's bf16 rows (fused combine)
#define PTXTRAIN_NVL_COMBINE 0
#endif
#define PTXTRAIN_NVL_MAX_RANKS 8  // (fused combine) ranks of one node

// (2) Whether some wait of this launch has timed out already (then no later wait waits: a dead
// peer costs one timeout per launch, not one per row).
__device__ __forceinline__ bool gave_up(const int* error) {
  return *reinterpret_cast<const volatile int*>(error) != 0;
}

// (2) Waits until *flag >= target; called by a whole warp with the same arguments. Every lane
// polls with acquire loads and the warp leaves when all lanes saw the flag (each has its own
// acquire), or when lane 0 finds a timeout, or an earlier one (then it records `code`).
__device__ __forceinline__ void wait_progress(const long long* flag, long long target,
                                              long long timeout, int* error, int code) {
  const long long start = clock64_ptx();
  while (true) {
    if (__all_sync(0xffffffffu, ld_acquire_sys_64(flag) >= target)) break;
    const bool stop = gave_up(error) || clock64_ptx() - start > timeout;
    if (__shfl_sync(0xffffffffu, stop, 0)) {
      if ((threadIdx.x & 31) == 0) atomicExch(error, code);
      break;
    }
  }
}

// One warp copies one row of n int4: U 16-byte loads in flight per lane before their stores.
template <int U>
__device__ __forceinline__ void copy_row(int4* d, const int4* s, int n, int lane) {
  int j = lane;
  for (; j + 32 * (U - 1) < n; j += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_nc_v4(s + j + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) st_na_v4(d + j + 32 * u, v[u]);
  }
  for (; j < n; j += 32) st_na_v4(d + j, ld_nc_v4(s + j));
}

// (fused combine) Rows of source r in this rank's data area.
__device__ __forceinline__ const int4* region_of(const int4* mine, int r, long long cap_rows,
                                                 int stride16) {
  return mine + (long long)r * cap_rows * stride16;
}

// The group of row i in a list grouped by rank: the r with off[r] <= i < off[r + 1] (off has
// num_ranks + 1 ascending entries; a linear scan, num_ranks is a node's GPU count).
__device__ __forceinline__ int group_of(const long long* off, int num_ranks, long long i) {
  int r = 0;
  while (r + 1 < num_ranks && __ldg(off + r + 1) <= i) ++r;
  return r;
}

extern "C" __global__ void __launch_bounds__(PTXTRAIN_NVL_THREADS, 1) nvl_all_to_all_v(
    const int4* __restrict__ src, const long long* __restrict__ send_row, int num_send,
    int4* __restrict__ out, int num_recv, const long long* __restrict__ send_off,
    const long long* __restrict__ recv_off,
    const long long* __restrict__ peer_bases, int rank, int num_ranks,
    int stride16, long long cap_rows, long long data_offset, int epoch, long long timeout,
    int* __restrict__ error, int send_blocks, const long long* __restrict__ slot, int hidden) {
  const int num_blocks = gridDim.x;
  const int nflags = num_ranks * num_blocks;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  const long long gwarp = (long long)blockIdx.x * nwarps + warp;
  const long long gstep = (long long)num_blocks * nwarps;
  int* my_flags = reinterpret_cast<int*>(peer_bases[rank]);

#if PTXTRAIN_NVL_PIPELINE == 2
  // Sender blocks [0, send_blocks) and receiver blocks [send_blocks, G) (see the design note).
  const long long tag = (long long)epoch << 32;  // progress = tag | rounds released
  (void)gwarp;  // (the split variant has its own warp numbering)
  (void)gstep;
  const long long sstep = (long long)send_blocks * nwarps;  // sender warps of the grid
  if (blockIdx.x < send_blocks) {
    wait_flags(my_flags + nflags, nflags, epoch - 1, timeout, error, 1);
    const long long sw = (long long)blockIdx.x * nwarps + warp;
#if PTXTRAIN_NVL_COMBINE
    // Fused combine: every receiver sums each token over all sources at once, so a round goes
    // to every peer (the sources progress together) instead of one peer per turn.
    long long rounds = 0;
    for (int d = 0; d < num_ranks; ++d) {
      const long long per_warp = (send_off[d + 1] - send_off[d] + sstep - 1) / sstep;
      if (d != rank)
        rounds = max(rounds, (per_warp + PTXTRAIN_NVL_ROUND_ROWS - 1) / PTXTRAIN_NVL_ROUND_ROWS);
    }
    for (long long t = 0; t < rounds; ++t) {
      for (int k = 0; k + 1 < num_ranks; ++k) {
        const int dst = (rank + 1 + k) % num_ranks;
        const long long first = send_off[dst], count = send_off[dst + 1] - first;
        int4* region = reinterpret_cast<int4*>(peer_bases[dst] + data_offset) +
                       (long long)rank * cap_rows * stride16;
        for (int i = 0; i < PTXTRAIN_NVL_ROUND_ROWS; ++i) {
          const long long j = (t * PTXTRAIN_NVL_ROUND_ROWS + i) * sstep + sw;
          if (j < count)
            copy_row<PTXTRAIN_NVL_UNROLL>(region + j * stride16,
                                          src + send_row[first + j] * stride16, stride16, lane);
        }
      }
      __syncthreads();  // the block's rows of round t are written, to every peer
      if (threadIdx.x + 1 < num_ranks) {
        const int dst = (rank + 1 + threadIdx.x) % num_ranks;
        fence_acq_rel_sys();
        st_release_sys_64(reinterpret_cast<long long*>(
                              reinterpret_cast<int*>(peer_bases[dst]) + 2 * nflags) +
                              rank * num_blocks + blockIdx.x,
                          tag | (t + 1));
      }
    }
#else
    // Turn k: every rank sends to rank + 1 + k and (below) receives from rank - 1 - k, a
    // perfect matching per turn, so receivers drain the source whose rows arrive first.
    for (int k = 0; k + 1 < num_ranks; ++k) {
      const int dst = (rank + 1 + k) % num_ranks;
      const long long first = send_off[dst], count = send_off[dst + 1] - first;
      int4* region = reinterpret_cast<int4*>(peer_bases[dst] + data_offset) +
                     (long long)rank * cap_rows * stride16;
      long long* progress = reinterpret_cast<long long*>(
                                reinterpret_cast<int*>(peer_bases[dst]) + 2 * nflags) +
                            rank * num_blocks + blockIdx.x;
      const long long per_warp = (count + sstep - 1) / sstep;  // rows of the busiest warp
      const long long rounds = (per_warp + PTXTRAIN_NVL_ROUND_ROWS - 1) / PTXTRAIN_NVL_ROUND_ROWS;
      for (long long t = 0; t < rounds; ++t) {
        for (int i = 0; i < PTXTRAIN_NVL_ROUND_ROWS; ++i) {
          const long long j = (t * PTXTRAIN_NVL_ROUND_ROWS + i) * sstep + sw;
          if (j < count)
            copy_row<PTXTRAIN_NVL_UNROLL>(region + j * stride16,
                                          src + send_row[first + j] * stride16, stride16, lane);
        }
        __syncthreads();  // the block's rows of round t are written
        if (threadIdx.x == 0) {
          fence_acq_rel_sys();
          st_release_sys_64(progress, tag | (t + 1));
        }
      }
    }
#endif
  } else {
    const long long rw = (long long)(blockIdx.x - send_blocks) * nwarps + warp;
    const long long rstep = (long long)(num_blocks - send_blocks) * nwarps;
#if PTXTRAIN_NVL_COMBINE
    // Fused combine: out is [num_recv = T, hidden] bf16; token t sums, in ascending rank order
    // from 0 in fp32 and rounded once (as layout.combine_sum), its row from every rank r with
    // slot[t][r] = p >= 0: place j = p - recv_off[r] of r's rows (this rank's own: input row
    // send_row[send_off[rank] + j]; a peer's: in its region once every sender block of r has
    // released round (j / sstep) / ROUND_ROWS).
    const int4* mine = reinterpret_cast<const int4*>(peer_bases[rank] + data_offset);
    const long long* progress = reinterpret_cast<const long long*>(my_flags + 2 * nflags);
    // rounds that every sender block of rank r has released, per warp (shared memory: indexed
    // by a runtime r without a local-memory array)
    __shared__ long long done_all[PTXTRAIN_NVL_THREADS / 32][PTXTRAIN_NVL_MAX_RANKS];
    long long* done = done_all[warp];
    if (lane < PTXTRAIN_NVL_MAX_RANKS) done[lane] = 0;
    __syncwarp();
    const int h16 = hidden / 8;  // int4 words (8 bf16) per row
    for (long long t = rw; t < num_recv; t += rstep) {
      for (int r = 0; r < num_ranks; ++r) {  // wait for the rounds that hold t's peer rows
        const long long p = slot[t * num_ranks + r];
        if (p < 0 || r == rank) continue;
        const long long need = ((p - recv_off[r]) / sstep) / PTXTRAIN_NVL_ROUND_ROWS + 1;
        if (done[r] >= need) continue;
        const long long start = clock64_ptx();
        long long low = 0;
        while (low < need) {  // every lane polls some sender blocks; the warp takes the min
          low = 0x7fffffffffffffffLL;
          for (int b = lane; b < send_blocks; b += 32) {
            const long long v = ld_acquire_sys_64(progress + r * num_blocks + b) - tag;
            low = min(low, v < 0 ? 0 : v);
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) low = min(low, __shfl_xor_sync(0xffffffffu, low, o));
          // lane 0 decides, for the whole warp (the shuffles above need every lane)
          bool stop = low < need && (gave_up(error) || clock64_ptx() - start > timeout);
          if (__shfl_sync(0xffffffffu, stop, 0)) {
            if (lane == 0) atomicExch(error, 2);
            break;
          }
        }
        __syncwarp();
        if (lane == 0) done[r] = low;
        __syncwarp();  // (also orders every lane's loads of r's rows after the lanes' acquires)
      }
      for (int c0 = lane; c0 < h16; c0 += 32 * PTXTRAIN_NVL_UNROLL) {
        float acc[PTXTRAIN_NVL_UNROLL][8];
#pragma unroll
        for (int u = 0; u < PTXTRAIN_NVL_UNROLL; ++u)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
        for (int r = 0; r < num_ranks; ++r) {  // ascending ranks: the order of the sum
          const long long p = slot[t * num_ranks + r];
          if (p < 0) continue;
          const long long j = p - recv_off[r];
          const int4* row = r == rank ? src + send_row[send_off[rank] + j] * stride16
                                      : region_of(mine, r, cap_rows, stride16) + j * stride16;
          int4 v[PTXTRAIN_NVL_UNROLL];
#pragma unroll
          for (int u = 0; u < PTXTRAIN_NVL_UNROLL; ++u)
            v[u] = c0 + 32 * u < h16 ? ld_nc_v4(row + c0 + 32 * u) : make_int4(0, 0, 0, 0);
#pragma unroll
          for (int u = 0; u < PTXTRAIN_NVL_UNROLL; ++u) {
            const u32 w[4] = {(u32)v[u].x, (u32)v[u].y, (u32)v[u].z, (u32)v[u].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              acc[u][2 * e] += __uint_as_float(w[e] << 16);
              acc[u][2 * e + 1] += __uint_as_float(w[e] & 0xffff0000u);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < PTXTRAIN_NVL_UNROLL; ++u) {
          if (c0 + 32 * u >= h16) continue;
          int4 o;
          o.x = (int)cvt_bf16x2(acc[u][0], acc[u][1]);
          o.y = (int)cvt_bf16x2(acc[u][2], acc[u][3]);
          o.z = (int)cvt_bf16x2(acc[u][4], acc[u][5]);
          o.w = (int)cvt_bf16x2(acc[u][6], acc[u][7]);
          st_na_v4(out + t * h16 + c0 + 32 * u, o);
        }
      }
    }
#else
    {  // this rank's own rows: straight from the input, no flags
      const long long first = send_off[rank], count = send_off[rank + 1] - first;
      int4* dst = out + recv_off[rank] * stride16;
      for (long long j = rw; j < count; j += rstep)
        copy_row<PTXTRAIN_NVL_UNROLL>(dst + j * stride16, src + send_row[first + j] * stride16,
                                      stride16, lane);
    }
    const int4* mine = reinterpret_cast<const int4*>(peer_bases[rank] + data_offset);
    const long long* progress = reinterpret_cast<const long long*>(my_flags + 2 * nflags);
    for (int k = 0; k + 1 < num_ranks; ++k) {
      const int s = (rank + num_ranks - 1 - k) % num_ranks;  // it sends to this rank in turn k
      const long long first = recv_off[s], count = recv_off[s + 1] - first;
      const int4* region = mine + (long long)s * cap_rows * stride16;
      long long seen_block = -1, seen = 0;  // the last progress read, and whose
      for (long long j = rw; j < count; j += rstep) {
        // place j was written by sender warp j % sstep of s, in round (j / sstep) / ROUND_ROWS
        const long long b = (j % sstep) / nwarps;
        const long long need = tag | ((j / sstep) / PTXTRAIN_NVL_ROUND_ROWS + 1);
        if (b != seen_block || seen < need) {
          wait_progress(progress + s * num_blocks + b, need, timeout, error, 2);
          seen_block = b;
          seen = need;
        }
        copy_row<PTXTRAIN_NVL_UNROLL>(out + (first + j) * stride16, region + j * stride16,
                                      stride16, lane);
      }
    }
#endif  // PTXTRAIN_NVL_COMBINE
  }
#else
  // 1. Peers have finished reading the previous operation's rows.
  wait_flags(my_flags + nflags, nflags, epoch - 1, timeout, error, 1);

#if PTXTRAIN_NVL_PIPELINE
  // 2. (pipelined) Per destination, warp w takes the slots j = w, w + gstep, ...: block b of
  // every rank writes exactly the slots that block b of the destination copies out in 4. The
  // rows for this rank itself skip the buffer: they go straight to their output rows (place j
  // of this rank's own group is output row recv_off[rank] + j). Warp w visits the destinations
  // starting at rank + 1 + w, so at any time about 1/R of the warps copy locally while the
  // others push over NVLink (16 SMs of pushes fill the link).
  for (int k = 0; k < num_ranks; ++k) {
    const int dst = (int)((rank + 1 + gwarp + k) % num_ranks);
    const long long first = send_off[dst], count = send_off[dst + 1] - first;
    int4* region = dst == rank ? out + recv_off[rank] * stride16
                               : reinterpret_cast<int4*>(peer_bases[dst] + data_offset) +
                                     (long long)rank * cap_rows * stride16;
    for (long long j = gwarp; j < count; j += gstep)
      copy_row<PTXTRAIN_NVL_UNROLL>(region + j * stride16, src + send_row[first + j] * stride16,
                                    stride16, lane);
  }
#else
  // 2. Rows straight into the destination's region for this rank (send row i goes to the dst
  // whose group holds it, at place i - send_off[dst]).
  for (long long i = gwarp; i < num_send; i += gstep) {
    const int dst = group_of(send_off, num_ranks, i);
    const int4* s = src + send_row[i] * stride16;
    int4* d = reinterpret_cast<int4*>(peer_bases[dst] + data_offset) +
              ((long long)rank * cap_rows + (i - send_off[dst])) * stride16;
    copy_row<PTXTRAIN_NVL_UNROLL>(d, s, stride16, lane);
  }
#endif

  // 3. This block's rows are written: release ready[rank][block] in every peer.
  __syncthreads();
  for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
    fence_acq_rel_sys();
    st_release_sys(reinterpret_cast<int*>(peer_bases[p]) + rank * num_blocks + blockIdx.x, epoch);
  }

  const int4* mine = reinterpret_cast<const int4*>(peer_bases[rank] + data_offset);
#if PTXTRAIN_NVL_PIPELINE
  // 4. (pipelined) Per peer source: wait for that source's block with this block's index only
  // (it wrote exactly the slots this block reads), then copy its rows out. (This rank's own rows
  // were copied in 2.)
  for (int i = 1; i < num_ranks; ++i) {
    const int s = (rank + i) % num_ranks;
    wait_flags(my_flags + s * num_blocks + blockIdx.x, 1, epoch, timeout, error, 2);
    const long long first = recv_off[s], count = recv_off[s + 1] - first;
    const int4* region = mine + (long long)s * cap_rows * stride16;
    for (long long j = gwarp; j < count; j += gstep)
      copy_row<PTXTRAIN_NVL_UNROLL>(out + (first + j) * stride16, region + j * stride16, stride16,
                                    lane);
  }
#else
  // 4. Every source's rows have arrived: copy them out in the receive order.
  wait_flags(my_flags, nflags, epoch, timeout, error, 2);
  for (long long k = gwarp; k < num_recv; k += gstep) {
    const int src_rank = group_of(recv_off, num_ranks, k);
    const int4* s = mine + ((long long)src_rank * cap_rows + (k - recv_off[src_rank])) * stride16;
    int4* d = out + k * stride16;
    copy_row<PTXTRAIN_NVL_UNROLL>(d, s, stride16, lane);
  }
#endif

#endif  // PTXTRAIN_NVL_PIPELINE == 2

  // 5. This block is done reading: release freed[rank][block] in every peer.
  __syncthreads();
  for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
    fence_acq_rel_sys();
    st_release_sys(reinterpret_cast<int*>(peer_bases[p]) + nflags + rank * num_blocks + blockIdx.x,
                   epoch);
  }
}
