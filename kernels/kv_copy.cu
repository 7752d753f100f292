// kvring KV copy kernel: between an engine's paged KV cache, in any layout a
// kvring layout descriptor describes, and a contiguous chunk object,
// [layer][token][head][K then V].
//
// The host hands over a copy plan (kvring::kv::CopyPlan): a page (one block
// of one layer: block_tokens * heads rows) moves as run_tokens * run_heads
// runs per part, each contiguous at both ends: one per row and part (K and
// V apart), one per row (K and V side by side), one per token (heads side
// by side too), or one per page. Row (token t, head h) of block b, part p,
// starts at layer.base[p] + b * block_stride + h * head_stride + t *
// token_stride in the engine, and at ((first_token + t) * heads + h) *
// row_bytes + row_offset[p] in the object.
//
// Job words (kvring::job_words): before each copy, `kv_gate` (one thread,
// on the same stream) stores `seq` into the job's `entered` word, fences at
// system scope and reads the job's `cancel` word (host memory its client
// writes), and leaves its verdict in device memory (`verdict`); every CTA of
// the copy reads the verdict and copies nothing if the client gave
// generation `generation` up. The client stores `cancel`, then reads
// `entered`: either the gate sees the cancel, or the client sees the copy
// entered and waits for the copy stream's `done` write after the kernel.
// (One thread crosses the bus, not every CTA: host-memory accesses to one
// word from hundreds of CTAs serialize.)
//
// A CTA copies one page at a time, striding over the chunk's pages by the
// grid size (one CTA per page on the staged path; a bounded grid on the
// zero-copy path, where `object` is pinned host memory). Its threads move
// words of `vec` bytes (16 wherever every address and size allows).

struct LayerEntry {
    unsigned long long base[2];
    unsigned long long block_stride;
    unsigned long long head_stride;
    unsigned long long token_stride;
};

struct KvCopyArgs {
    unsigned int num_layers;
    unsigned int blocks_per_chunk;
    unsigned int skip_blocks;
    // 0: engine -> object (store), 1: object -> engine (retrieve)
    unsigned int to_engine;
    unsigned int block_tokens;
    unsigned int heads;
    unsigned int run_tokens;
    unsigned int run_heads;
    unsigned int parts;
    unsigned int vec;
    unsigned int chunk_tokens;
    unsigned int _pad;
    unsigned long long row_bytes;
    unsigned long long width[2];
    unsigned long long row_offset[2];
    // Device addresses of the job's entered[worker] and cancel words and of
    // the gate's verdict (device memory); verdict 0: no job words.
    unsigned long long entered;
    unsigned long long cancel;
    unsigned long long verdict;
    unsigned int seq;
    unsigned int generation;
};

// The gate before a copy (one thread): see above.
extern "C" __global__ void kv_gate(KvCopyArgs a) {
    *(volatile unsigned int*)a.entered = a.seq;
    __threadfence_system();
    unsigned int c = *(volatile unsigned int*)a.cancel;
    // Cyclic: cancel has reached generation.
    *(volatile unsigned int*)a.verdict = (int)(c - a.generation) < 0 ? 1u : 0u;
}

// Whether this CTA may copy: the gate found the job open.
__device__ bool job_open(const KvCopyArgs& a) {
    return a.verdict == 0 || *(const volatile unsigned int*)a.verdict != 0;
}

template <typename W>
__device__ __forceinline__ void move_word(unsigned char* eng, unsigned char* obj, bool to_engine) {
    if (to_engine) {
        *(W*)eng = *(const W*)obj;
    } else {
        *(W*)obj = *(const W*)eng;
    }
}

template <typename W>
__device__ void copy_page(const LayerEntry& e, unsigned long long b, unsigned char* obj_page,
                          const KvCopyArgs& a) {
    const unsigned int vec = sizeof(W);
    const bool to_engine = a.to_engine != 0;
    for (unsigned int part = 0; part < a.parts; ++part) {
        unsigned char* eng0 = (unsigned char*)(e.base[part] + b * e.block_stride);
        unsigned char* obj0 = obj_page + a.row_offset[part];
        unsigned long long words = a.width[part] / vec;
        unsigned long long units = (unsigned long long)a.run_tokens * a.run_heads;
        if (units == 1) {
            // One run per page: a straight copy.
            for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) {
                move_word<W>(eng0 + i * vec, obj0 + i * vec, to_engine);
            }
            continue;
        }
        unsigned long long total = units * words;
        if (total <= 0xffffffffull) {
            // 32-bit index arithmetic (the common case): divisions are cheap.
            unsigned int w32 = (unsigned int)words;
            for (unsigned int i = threadIdx.x; i < (unsigned int)total; i += blockDim.x) {
                unsigned int u = i / w32;
                unsigned int w = i - u * w32;
                unsigned int t = u / a.run_heads;
                unsigned int h = u - t * a.run_heads;
                unsigned char* eng = eng0 + h * e.head_stride + t * e.token_stride + (unsigned long long)w * vec;
                unsigned char* obj =
                    obj0 + ((unsigned long long)t * a.heads + h) * a.row_bytes + (unsigned long long)w * vec;
                move_word<W>(eng, obj, to_engine);
            }
        } else {
            for (unsigned long long i = threadIdx.x; i < total; i += blockDim.x) {
                unsigned long long u = i / words;
                unsigned long long w = i - u * words;
                unsigned long long t = u / a.run_heads;
                unsigned long long h = u - t * a.run_heads;
                unsigned char* eng = eng0 + h * e.head_stride + t * e.token_stride + w * vec;
                unsigned char* obj = obj0 + (t * a.heads + h) * a.row_bytes + w * vec;
                move_word<W>(eng, obj, to_engine);
            }
        }
    }
}

extern "C" __global__ void kv_copy(const LayerEntry* __restrict__ layers,
                                   const unsigned int* __restrict__ blocks,
                                   unsigned char* __restrict__ object,
                                   KvCopyArgs a) {
    if (!job_open(a)) {
        return;
    }
    unsigned int bpc = a.blocks_per_chunk;
    unsigned int pages = a.num_layers * bpc;
    for (unsigned int page = blockIdx.x; page < pages; page += gridDim.x) {
        unsigned int layer = page / bpc;
        unsigned int j = page - layer * bpc;
        if (j < a.skip_blocks) {
            continue;
        }
        LayerEntry e = layers[layer];
        unsigned long long b = blocks[j];
        unsigned long long first_token =
            (unsigned long long)layer * a.chunk_tokens + (unsigned long long)j * a.block_tokens;
        unsigned char* obj_page = object + first_token * a.heads * a.row_bytes;
        switch (a.vec) {
            case 16: copy_page<uint4>(e, b, obj_page, a); break;
            case 8: copy_page<unsigned long long>(e, b, obj_page, a); break;
            case 4: copy_page<unsigned int>(e, b, obj_page, a); break;
            case 2: copy_page<unsigned short>(e, b, obj_page, a); break;
            default: copy_page<unsigned char>(e, b, obj_page, a); break;
        }
    }
}
