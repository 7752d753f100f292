//! Registration: any registration message and tables against the
//! server's registry, and any layout descriptor against its own addressing.

use super::Input;
use kvring::kv::{Dtype, KvGeometry, KvLayout, KvShape, LayerPlacement, LayoutPreset};
use kvring::proto::kv::{KvAllocation, MemoryPiece, RegisterKv, RegisterTables};
use std::sync::OnceLock;

/// A sealed memfd of `bytes` bytes, or an unsealed one.
fn memfd(bytes: u64, sealed: bool) -> std::os::fd::OwnedFd {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(c"kvring-fuzz", MFdFlags::MFD_ALLOW_SEALING).expect("memfd");
    nix::unistd::ftruncate(&fd, bytes as i64).expect("ftruncate");
    if sealed {
        use std::os::fd::AsRawFd;
        // SAFETY: F_ADD_SEALS on a descriptor this function owns.
        let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(r, 0, "seal");
    }
    fd
}

/// A layout from fuzz input: a preset of a small geometry with some of its
/// numbers overwritten, or every number raw.
fn fuzz_descriptor(inp: &mut Input<'_>) -> KvLayout {
    let raw = inp.u8() % 4 == 0;
    let mut g = KvGeometry::mha(
        KvShape {
            layers: 1 + u32::from(inp.u8() % 4),
            blocks: 1 + u32::from(inp.u8() % 8),
            block_tokens: 1 << (inp.u8() % 4),
            heads: 1 + u32::from(inp.u8() % 3),
            head_dim: 1 + u32::from(inp.u8() % 12),
        },
        [Dtype::Fp8, Dtype::Bf16, Dtype::F32][usize::from(inp.u8() % 3)],
    );
    if inp.u8() % 4 == 0 {
        g = KvGeometry::mla(g.layers, g.blocks, g.block_tokens, g.k_dim, Dtype::Bf16);
    }
    let preset = LayoutPreset::ALL[usize::from(inp.u8()) % LayoutPreset::ALL.len()];
    let base = KvLayout::preset(preset, g)
        .or_else(|_| KvLayout::preset(LayoutPreset::Lbnhc, g))
        .expect("a one-buffer preset fits every geometry");
    let mut allocs = base.allocations().to_vec();
    let mut layers = base.layers().to_vec();
    if raw {
        let mut raw_g = [0u8; std::mem::size_of::<KvGeometry>()];
        let b = inp.bytes(raw_g.len());
        raw_g[..b.len()].copy_from_slice(b);
        g = bytemuck::pod_read_unaligned(&raw_g);
        g.layers %= 5;
        allocs = (0..inp.u8() % 3).map(|_| inp.u64() % (1 << 20)).collect();
        layers = (0..g.layers)
            .map(|_| {
                let mut raw_p = [0u8; std::mem::size_of::<LayerPlacement>()];
                let b = inp.bytes(raw_p.len());
                raw_p[..b.len()].copy_from_slice(b);
                bytemuck::pod_read_unaligned(&raw_p)
            })
            .collect();
    } else {
        // Hostile edits: any field of any placement, or an allocation size.
        for _ in 0..inp.u8() % 4 {
            let v = match inp.u8() % 4 {
                0 => inp.u64(),
                1 => u64::from(inp.u16()),
                2 => 0,
                _ => u64::MAX - u64::from(inp.u8()),
            };
            let field = inp.u8();
            if field % 8 == 7 {
                if let Some(a) = allocs.first_mut() {
                    *a = v;
                }
                continue;
            }
            let n = layers.len();
            let p = &mut layers[usize::from(inp.u8()) % n];
            match field % 8 {
                0 => p.k_offset = v,
                1 => p.v_offset = v,
                2 => p.block_stride = v,
                3 => p.head_stride = v,
                4 => p.token_stride = v,
                5 => p.alloc = v as u32,
                _ => p.k_offset = p.v_offset.wrapping_add(v % 64),
            }
        }
    }
    KvLayout::new(g, allocs, layers)
}

/// Any registration against the registry, and any layout against its own
/// addressing.
pub fn registration(data: &[u8]) {
    let mut inp = Input(data);
    let chunk_tokens = 1 + u32::from(inp.u16()) % 1024;
    let layout = fuzz_descriptor(&mut inp);
    check_layout(&layout, chunk_tokens);
    let mut raw = [0u8; std::mem::size_of::<RegisterKv>()];
    let head = inp.bytes(raw.len());
    raw[..head.len()].copy_from_slice(head);
    let mut req: RegisterKv = bytemuck::pod_read_unaligned(&raw);
    // Mostly host memory (the only kind without a GPU), mostly the
    // descriptor built above in one memfd.
    if inp.u8() % 4 != 0 {
        req.mem_kind = kvring::proto::kv::MemKind::HostFd as u32;
    }
    let table = if inp.u8() % 4 != 0 {
        req.geometry = *layout.geometry();
        let mut at = 0u64;
        let mut t = RegisterTables {
            allocs: Vec::new(),
            pieces: Vec::new(),
            layers: layout.layers().to_vec(),
        };
        for &bytes in layout.allocations() {
            t.allocs.push(KvAllocation {
                ipc_handle: [0; 64],
                offset: 0,
                bytes,
                first_piece: t.pieces.len() as u32,
                n_pieces: 1,
            });
            t.pieces.push(MemoryPiece {
                first_fd: u32::from(inp.u8() % 2),
                n_fds: 1,
                fd_offset: at,
                fd_bytes: bytes,
            });
            at = at.wrapping_add(bytes.wrapping_add(4095) & !4095);
        }
        req.n_allocs = t.allocs.len() as u32;
        req.n_pieces = t.pieces.len() as u32;
        t.encode()
    } else {
        inp.bytes(4096).to_vec()
    };

    static FDS: OnceLock<Vec<std::os::fd::OwnedFd>> = OnceLock::new();
    let fds = FDS.get_or_init(|| vec![memfd(1 << 20, true), memfd(1 << 20, false), memfd(0, true)]);
    let nfds = usize::from(inp.u8()) % (fds.len() + 1);
    let sent: Vec<std::os::fd::OwnedFd> = fds[..nfds]
        .iter()
        .map(|f| f.try_clone().expect("dup"))
        .collect();
    let mut reg = crate::registry::Registry::default();
    let backend = crate::HostBackend;
    if let Ok(inst) = reg.register(3, 1, None, chunk_tokens, &req, &table, &sent, &backend) {
        let l = &inst.layout;
        assert!(l.validate(chunk_tokens).is_ok());
        assert_eq!(inst.host.len(), l.allocations().len());
        // Host memory by type: `host` holds only host mappings.
        for (m, &bytes) in inst.host.iter().zip(l.allocations()) {
            assert!(
                m.bytes() >= bytes,
                "an allocation mapped smaller than its layout"
            );
        }
        check_layout(l, chunk_tokens);
        assert_eq!(reg.len(), 1);
        assert!(reg.unregister(3, 1, inst.id));
        assert_eq!(reg.len(), 0);
    }
}

/// A layout that validates addresses only its allocations and objects, and
/// no two of its rows share a byte (checked byte range by byte range).
fn check_layout(l: &KvLayout, chunk_tokens: u32) {
    if l.validate(chunk_tokens).is_err() {
        return;
    }
    let g = l.geometry();
    let bpc = l.blocks_per_chunk(chunk_tokens);
    assert!(bpc >= 1);
    let ob = l.object_bytes(chunk_tokens);
    let plan = l.plan();
    // Every run of every page, with the blocks of one chunk placed at the
    // start of the object (larger block counts cycle through it).
    let mut ranges: Vec<(u32, u64, u64)> = Vec::new();
    let rows = u64::from(g.layers) * u64::from(g.blocks) * g.page_bytes() / g.row_bytes().max(1);
    for layer in 0..g.layers {
        let alloc = l.layers()[layer as usize].alloc;
        for block in 0..g.blocks {
            let j = block % bpc;
            plan.for_each_run(l, chunk_tokens, layer, block, j, |_, eng, obj, n| {
                assert!(
                    eng.checked_add(n)
                        .is_some_and(|e| e <= l.allocations()[alloc as usize]),
                    "a run past its allocation"
                );
                assert!(
                    obj.checked_add(n).is_some_and(|e| e <= ob),
                    "a run past the object"
                );
                if rows <= 1 << 14 {
                    ranges.push((alloc, eng, eng + n));
                }
            });
        }
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(
            w[0].0 != w[1].0 || w[0].2 <= w[1].1,
            "two runs share bytes: {:?} {:?}",
            w[0],
            w[1]
        );
    }
}
