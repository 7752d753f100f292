//! The global allocator of the programs that run a server (feature
//! `jemalloc`: `kvring` and `kvring-bench`; not the Python package's
//! extension, which lives in an interpreter's process), and its one
//! setting.
//!
//! The second tier moves 32 MiB values: one SET command and one GET reply
//! buffer each. glibc maps every allocation over 32 MiB afresh and unmaps
//! it on free, 8,192 page faults per value (18-21 ms of a 32 MiB SET or GET
//! on a small VM). jemalloc keeps freed pages mapped and reuses them, once
//! its separate arena for allocations over 8 MiB, which returns their pages
//! at once, is turned off (`oversize_threshold:0`); freed pages go back to
//! the system after its usual decay (10 s).

#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read before `main` (its `malloc_conf`; the crate's
/// symbols carry the `_rjem_` prefix). `_RJEM_MALLOC_CONF` in the
/// environment still overrides them.
#[export_name = "_rjem_malloc_conf"]
#[used]
static MALLOC_CONF: Option<&'static std::ffi::c_char> = {
    let conf = c"oversize_threshold:0";
    // SAFETY: the first byte of a NUL-terminated string that lives as long
    // as the program; jemalloc reads it as a C string and never writes it.
    Some(unsafe { &*conf.as_ptr() })
};
