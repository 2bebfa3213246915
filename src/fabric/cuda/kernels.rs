//! The `cuda` fabric's CUDA C kernels, compiled by NVRTC at start-up.

/// The kernels, compiled by NVRTC when the transport starts (no toolkit needed where kvrelay is built).
pub(super) const KERNELS: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
struct Copy { u64 src; u64 dst; u64 len; };
struct Check { u64 addr; u64 source; u64 len; u64 block; u64 stride; };
struct Run { u64 src; u64 dst; u64 len; u64 count; u64 src_stride; u64 dst_stride; };
struct Paged {
    u64 src; u64 src_off; u64 dst; u64 dst_off; u64 len; u64 count; u64 src_stride; u64 dst_stride;
    u64 src_table; u64 dst_table; u64 src_item; u64 dst_item; u64 first_chunk; u64 per_chunk; u64 unit;
};

#define SENTINEL 0x5E5E5E5E5E5E5E5Eull
#define LANE (threadIdx.x & 31u)
#define WARP (((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5)
#define WARPS (((u64)gridDim.x * blockDim.x) >> 5)

// One warp per descriptor, 16-byte moves where source, target and length allow, 8-byte or single bytes otherwise.
extern "C" __global__ void kv_gather(const Copy* copies, u64 count) {
    for (u64 i = WARP; i < count; i += WARPS) {
        const Copy c = copies[i];
        const u64 align = c.src | c.dst | c.len;
        if ((align & 15) == 0) {
            const uint4* s = (const uint4*)c.src; uint4* d = (uint4*)c.dst;
            for (u64 k = LANE; k < c.len / 16; k += 32) d[k] = s[k];
        } else if ((align & 7) == 0) {
            const u64* s = (const u64*)c.src; u64* d = (u64*)c.dst;
            for (u64 k = LANE; k < c.len / 8; k += 32) d[k] = s[k];
        } else {
            const unsigned char* s = (const unsigned char*)c.src; unsigned char* d = (unsigned char*)c.dst;
            for (u64 k = LANE; k < c.len; k += 32) d[k] = s[k];
        }
    }
}

// One warp per run (at most 32 KiB of a strided entry: `count` elements of `len` bytes at strides on both sides): the
// run's 16-byte words (8-byte or single bytes where addresses, strides or length are not aligned) spread over the
// lanes in element order, so consecutive lanes read and write consecutive words; four loads in flight per lane
// before their stores.
#define RUN_AT(T, base, u) ((T*)((base) + (u64)((u) / per) * stride) + (u) % per)
extern "C" __global__ void kv_strided(const Run* runs, u64 count) {
    for (u64 i = WARP; i < count; i += WARPS) {
        const Run r = runs[i];
        const u64 align = r.src | r.dst | r.len | r.src_stride | r.dst_stride;
        if ((align & 15) == 0) {
            const unsigned per = (unsigned)(r.len / 16), total = per * (unsigned)r.count;
            unsigned u = LANE;
            for (; u + 96 < total; u += 128) {
                u64 stride = r.src_stride;
                const uint4 a = *RUN_AT(const uint4, r.src, u), b = *RUN_AT(const uint4, r.src, u + 32);
                const uint4 c = *RUN_AT(const uint4, r.src, u + 64), d = *RUN_AT(const uint4, r.src, u + 96);
                stride = r.dst_stride;
                *RUN_AT(uint4, r.dst, u) = a; *RUN_AT(uint4, r.dst, u + 32) = b;
                *RUN_AT(uint4, r.dst, u + 64) = c; *RUN_AT(uint4, r.dst, u + 96) = d;
            }
            for (; u < total; u += 32) {
                u64 stride = r.src_stride;
                const uint4 a = *RUN_AT(const uint4, r.src, u);
                stride = r.dst_stride;
                *RUN_AT(uint4, r.dst, u) = a;
            }
        } else if ((align & 7) == 0) {
            const unsigned per = (unsigned)(r.len / 8), total = per * (unsigned)r.count;
            for (unsigned u = LANE; u < total; u += 32) {
                u64 stride = r.src_stride;
                const u64 a = *RUN_AT(const u64, r.src, u);
                stride = r.dst_stride;
                *RUN_AT(u64, r.dst, u) = a;
            }
        } else {
            const unsigned per = (unsigned)r.len, total = per * (unsigned)r.count;
            for (unsigned u = LANE; u < total; u += 32) {
                u64 stride = r.src_stride;
                const unsigned char a = *RUN_AT(const unsigned char, r.src, u);
                stride = r.dst_stride;
                *RUN_AT(unsigned char, r.dst, u) = a;
            }
        }
    }
}

#define RUN_BYTES 32768ull
#define CHUNK_ELEMENTS 64
#define BLOCK_WARPS 8

// Region byte of logical byte `logical` through `table` (items of `item` bytes), or physical where there is none.
__device__ __forceinline__ u64 paged_at(u64 base, const u32* table, u64 item, u64 logical) {
    return table ? base + (u64)table[logical / item] * item + logical % item : base + logical;
}

// The warp moves `total` units of T: unit u is unit u % per of element u / per, whose addresses are src[] and dst[].
template <typename T>
__device__ __forceinline__ void move_units(const u64* src, const u64* dst, unsigned per, unsigned total) {
    unsigned u = LANE;
    for (; u + 96 < total; u += 128) {
        const T a = ((const T*)src[u / per])[u % per];
        const T b = ((const T*)src[(u + 32) / per])[(u + 32) % per];
        const T c = ((const T*)src[(u + 64) / per])[(u + 64) % per];
        const T d = ((const T*)src[(u + 96) / per])[(u + 96) % per];
        ((T*)dst[u / per])[u % per] = a;
        ((T*)dst[(u + 32) / per])[(u + 32) % per] = b;
        ((T*)dst[(u + 64) / per])[(u + 64) % per] = c;
        ((T*)dst[(u + 96) / per])[(u + 96) % per] = d;
    }
    for (; u < total; u += 32) ((T*)dst[u / per])[u % per] = ((const T*)src[u / per])[u % per];
}

// Paged and strided entries as they were submitted (one descriptor each, `count` elements at strides, offsets on a
// paged side logical bytes of its page table, the tables after the descriptors), cut on the device into chunks of
// at most CHUNK_ELEMENTS elements and RUN_BYTES bytes (an element over RUN_BYTES in pieces): one warp per chunk
// finds its descriptor by binary search over the chunk prefix, resolves its elements' addresses through the tables
// once into shared memory, then moves 16-byte words (8-byte or single bytes where anything is unaligned).
extern "C" __global__ void kv_paged(const Paged* descs, u64 n, u64 chunks) {
    __shared__ u64 addresses[BLOCK_WARPS][2][CHUNK_ELEMENTS];
    const u32* tables = (const u32*)(descs + n);
    u64* src = addresses[threadIdx.x >> 5][0];
    u64* dst = addresses[threadIdx.x >> 5][1];
    for (u64 c = WARP; c < chunks; c += WARPS) {
        u64 lo = 0, hi = n;
        while (hi - lo > 1) {
            const u64 mid = (lo + hi) / 2;
            if (descs[mid].first_chunk <= c) lo = mid; else hi = mid;
        }
        const Paged d = descs[lo];
        const u64 local = c - d.first_chunk;
        u64 first, elements, skip, bytes;
        if (d.per_chunk) {
            first = local * d.per_chunk;
            elements = d.count - first < d.per_chunk ? d.count - first : d.per_chunk;
            skip = 0;
            bytes = d.len;
        } else {
            const u64 pieces = (d.len + RUN_BYTES - 1) / RUN_BYTES;
            first = local / pieces;
            elements = 1;
            skip = (local % pieces) * RUN_BYTES;
            bytes = d.len - skip < RUN_BYTES ? d.len - skip : RUN_BYTES;
        }
        const u32* st = d.src_table ? tables + (d.src_table - 1) : 0;
        const u32* dt = d.dst_table ? tables + (d.dst_table - 1) : 0;
        __syncwarp();
        for (u64 k = LANE; k < elements; k += 32) {
            src[k] = paged_at(d.src, st, d.src_item, d.src_off + (first + k) * d.src_stride) + skip;
            dst[k] = paged_at(d.dst, dt, d.dst_item, d.dst_off + (first + k) * d.dst_stride) + skip;
        }
        __syncwarp();
        const unsigned per = (unsigned)(bytes / d.unit), total = per * (unsigned)elements;
        if (d.unit == 16) move_units<uint4>(src, dst, per, total);
        else if (d.unit == 8) move_units<u64>(src, dst, per, total);
        else move_units<unsigned char>(src, dst, per, total);
    }
}

// Source region `number`'s pattern over a whole allocation (8-byte aligned): word w is 1<<63 | number<<40 | w.
extern "C" __global__ void kv_fill_source(unsigned char* dst, u64 len, u64 number) {
    const u64 base = (1ull << 63) | (number << 40);
    const u64 words = len / 8;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 w = (u64)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += stride) ((u64*)dst)[w] = base | w;
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < len % 8) dst[words * 8 + t] = (unsigned char)((base | words) >> (8 * t));
}

__device__ __forceinline__ unsigned char expected_byte(u64 source, u64 sentinel, u64 at) {
    if (sentinel) return 0x5E;
    const u64 word = (1ull << 63) | ((source >> 40) << 40) | (at / 8);
    return (unsigned char)(word >> (8 * (at % 8)));
}

// Whether `len` bytes at `addr` are source `base`'s words from byte `offset` on (the sentinel where `sentinel`): a
// warp's lanes OR the differences they see.
__device__ __forceinline__ u64 judge_block(u64 addr, u64 offset, u64 len, u64 source, u64 sentinel) {
    const u64 base = sentinel ? 0 : ((1ull << 63) | ((source >> 40) << 40));
    u64 diff = 0;
    if (((addr | offset | len) & 15) == 0) {
        const uint4* found = (const uint4*)addr;
        for (u64 k = LANE; k < len / 16; k += 32) {
            const uint4 f = found[k];
            const u64 w0 = sentinel ? SENTINEL : (base | (offset / 8 + 2 * k));
            const u64 w1 = sentinel ? SENTINEL : (base | (offset / 8 + 2 * k + 1));
            diff |= ((((u64)f.y << 32) | f.x) ^ w0) | ((((u64)f.w << 32) | f.z) ^ w1);
        }
    } else if (((addr | offset | len) & 7) == 0) {
        const u64* found = (const u64*)addr;
        for (u64 k = LANE; k < len / 8; k += 32) diff |= found[k] ^ (sentinel ? SENTINEL : (base | (offset / 8 + k)));
    } else {
        const unsigned char* found = (const unsigned char*)addr;
        for (u64 k = LANE; k < len; k += 32) diff |= found[k] ^ expected_byte(source, sentinel, offset + k);
    }
    return diff;
}

// One warp per check: whether `len` bytes at `addr`, as blocks of `block` bytes, are source `number`'s with block k
// from byte `offset + k * stride` on (source packs number << 40 | offset), or the sentinel (len's top bit). A failing
// check sets bad[i] and *any.
extern "C" __global__ void kv_judge(const Check* checks, u64 count, u32* bad, u32* any) {
    for (u64 i = WARP; i < count; i += WARPS) {
        const Check c = checks[i];
        const u64 sentinel = c.len >> 63;
        const u64 len = c.len & ~(1ull << 63);
        const u64 offset = c.source & ((1ull << 40) - 1);
        u64 diff = 0;
        for (u64 at = 0, k = 0; at < len; at += c.block, k++) {
            diff |= judge_block(c.addr + at, offset + k * c.stride, c.block, c.source, sentinel);
        }
        if (__any_sync(0xffffffffu, diff != 0) && LANE == 0) { bad[i] = 1; *any = 1; }
    }
}

struct RowsCheck { u64 addr; u64 row; u64 source; u64 pattern_row; u64 first_run; u64 first_work; };
struct RowRun { u64 target; u64 source; u64 count; u64 step; };

// One warp per run of a table named by a check (runs cut on the host to at most PIECE_BYTES of the check's rows):
// it finds its check by binary search over the checks' first work items, then compares the run's rows, target row
// t at addr + t * row, source row s the pattern's bytes from s * pattern_row on (source packs number << 40, its top
// bit the sentinel). A failing run sets bad[check] and *any.
extern "C" __global__ void kv_judge_rows(const RowsCheck* checks, u64 n, const RowRun* runs, u64 works, u32* bad,
                                         u32* any) {
    for (u64 w = WARP; w < works; w += WARPS) {
        u64 lo = 0, hi = n;
        while (hi - lo > 1) {
            const u64 mid = (lo + hi) / 2;
            if (checks[mid].first_work <= w) lo = mid; else hi = mid;
        }
        const RowsCheck c = checks[lo];
        const RowRun r = runs[c.first_run + (w - c.first_work)];
        const u64 sentinel = c.source >> 63;
        u64 diff = 0;
        if (sentinel || (r.step == 1 && c.pattern_row == c.row)) {
            diff = judge_block(c.addr + r.target * c.row, r.source * c.pattern_row, r.count * c.row, c.source, sentinel);
        } else {
            for (u64 k = 0; k < r.count; k++) {
                const u64 at = (r.source + k * r.step) * c.pattern_row;
                diff |= judge_block(c.addr + (r.target + k) * c.row, at, c.row, c.source, sentinel);
            }
        }
        if (__any_sync(0xffffffffu, diff != 0) && LANE == 0) { bad[lo] = 1; *any = 1; }
    }
}
"#;
