// kvring KV copy kernels: between an engine's paged KV cache (any layout
// kvring knows) and a contiguous chunk object, [part][layer][token][H*D].
//
// A CTA copies one slab at a time: the `block_tokens` tokens of one block,
// for one layer and one part (K or V; MLA has one part), striding over the
// chunk's slabs by the grid size. Slab bytes are contiguous in every layout,
// so a slab is one straight copy, in 16-byte words when both ends and the
// size allow, else bytewise. With one CTA per slab (the staged path) each
// CTA copies one slab; a bounded grid (the zero-copy path, where `object` is
// pinned host memory) copies many each.
//
// Layout kinds (kvring::kv::KvLayoutKind), slab (layer l, part p, block b):
//   1 flash-attn  [2, NB, BS, H, D] per layer: tensor l, offset (p*NB + b)*S
//   2 FlashInfer  [NB, 2, BS, H, D] per layer: tensor l, offset (b*2 + p)*S
//   3 MLA         [NB, BS, D] per layer:       tensor l, offset b*S
//   4 cross-layer [NB, L, 2, BS, H, D]:        tensor 0, offset ((b*L + l)*2 + p)*S

struct KvCopyArgs {
    unsigned int kind;
    unsigned int num_layers;
    unsigned int parts;
    unsigned int num_blocks;
    unsigned int blocks_per_chunk;
    unsigned int skip_blocks;
    unsigned long long slab_bytes;
    // 0: engine -> object (store), 1: object -> engine (retrieve)
    unsigned int to_engine;
    unsigned int _pad;
};

__device__ __forceinline__ void copy_slab(unsigned char* __restrict__ dst,
                                          const unsigned char* __restrict__ src,
                                          unsigned long long n) {
    if ((((unsigned long long)dst | (unsigned long long)src | n) & 15ull) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        unsigned long long words = n >> 4;
        for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) {
            d[i] = s[i];
        }
    } else {
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            dst[i] = src[i];
        }
    }
}

extern "C" __global__ void kv_copy(const unsigned long long* __restrict__ tensor_bases,
                                   const unsigned int* __restrict__ blocks,
                                   unsigned char* __restrict__ object,
                                   KvCopyArgs a) {
    unsigned int bpc = a.blocks_per_chunk;
    unsigned int total = a.parts * a.num_layers * bpc;
    for (unsigned int slab = blockIdx.x; slab < total; slab += gridDim.x) {
    unsigned int j = slab % bpc;
    unsigned int row = slab / bpc;  // part * num_layers + layer
    if (j < a.skip_blocks) {
        continue;
    }
    unsigned int part = row / a.num_layers;
    unsigned int layer = row % a.num_layers;
    unsigned long long b = blocks[j];
    unsigned long long s = a.slab_bytes;
    unsigned long long nb = a.num_blocks;
    unsigned int tensor = layer;
    unsigned long long off;
    switch (a.kind) {
        case 1: off = ((unsigned long long)part * nb + b) * s; break;
        case 2: off = (b * 2ull + part) * s; break;
        case 3: off = b * s; break;
        default:
            tensor = 0;
            off = ((b * a.num_layers + layer) * 2ull + part) * s;
            break;
    }
    unsigned char* engine = (unsigned char*)tensor_bases[tensor] + off;
    unsigned char* obj = object + ((unsigned long long)row * bpc + j) * s;
    if (a.to_engine) {
        copy_slab(engine, obj, s);
    } else {
        copy_slab(obj, engine, s);
    }
    }
}
