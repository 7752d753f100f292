//! `kvring.Layout`: a KV cache's geometry and where each layer lives in
//! its allocations (the strided descriptor of `kvring::kv::KvLayout`).

use crate::errors::invalid;
use kvring::kv::{GeometryFlags, KvGeometry, KvLayout, LayerPlacement, LayoutPreset};
use pyo3::prelude::*;

/// A KV cache's layout (see the stub for the addressing rule).
#[pyclass(name = "Layout", module = "kvring", frozen)]
#[derive(Clone)]
pub struct PyLayout {
    pub layout: KvLayout,
}

fn dtype(py: Python<'_>, elem_bytes: u32) -> PyResult<kvring::kv::Dtype> {
    use kvring::kv::Dtype;
    Ok(match elem_bytes {
        1 => Dtype::Fp8,
        2 => Dtype::Bf16,
        4 => Dtype::F32,
        n => return Err(invalid(py, format!("elements of {n} bytes: 1, 2 or 4"))),
    })
}

#[pymethods]
impl PyLayout {
    #[new]
    #[pyo3(signature = (*, layers, blocks, block_tokens, heads, k_width, v_width, elem_bytes, allocations, placements, shared = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layers: u32,
        blocks: u32,
        block_tokens: u32,
        heads: u32,
        k_width: u32,
        v_width: u32,
        elem_bytes: u32,
        allocations: Vec<u64>,
        placements: Vec<(u32, u64, u64, u64, u64, u64)>,
        shared: bool,
    ) -> PyResult<PyLayout> {
        dtype(py, elem_bytes)?;
        let geometry = KvGeometry {
            layers,
            blocks,
            block_tokens,
            heads,
            k_dim: k_width,
            v_dim: v_width,
            elem_bytes,
            flags: if shared {
                GeometryFlags::SHARED.bits()
            } else {
                0
            },
        };
        let layers = placements
            .into_iter()
            .map(|(a, k, v, b, h, t)| LayerPlacement::new(a, k, v, b, h, t))
            .collect();
        Ok(PyLayout {
            layout: KvLayout::new(geometry, allocations, layers),
        })
    }

    /// A named layout (`LAYOUT_PRESETS`), its allocations as the preset
    /// sizes them.
    #[staticmethod]
    #[pyo3(signature = (name, *, layers, blocks, block_tokens, heads, head_dim, elem_bytes))]
    #[allow(clippy::too_many_arguments)]
    fn preset(
        py: Python<'_>,
        name: &str,
        layers: u32,
        blocks: u32,
        block_tokens: u32,
        heads: u32,
        head_dim: u32,
        elem_bytes: u32,
    ) -> PyResult<PyLayout> {
        let preset = LayoutPreset::from_name(name)
            .ok_or_else(|| invalid(py, format!("no layout preset {name:?}")))?;
        let dt = dtype(py, elem_bytes)?;
        let g = if preset == LayoutPreset::Mla {
            KvGeometry::mla(layers, blocks, block_tokens, head_dim, dt)
        } else {
            KvGeometry::mha(
                kvring::kv::KvShape {
                    layers,
                    blocks,
                    block_tokens,
                    heads,
                    head_dim,
                },
                dt,
            )
        };
        let layout = KvLayout::preset(preset, g).map_err(|e| invalid(py, e.to_string()))?;
        Ok(PyLayout { layout })
    }

    #[getter]
    fn layers(&self) -> u32 {
        self.layout.geometry().layers
    }
    #[getter]
    fn blocks(&self) -> u32 {
        self.layout.geometry().blocks
    }
    #[getter]
    fn block_tokens(&self) -> u32 {
        self.layout.geometry().block_tokens
    }
    #[getter]
    fn heads(&self) -> u32 {
        self.layout.geometry().heads
    }
    /// Bytes of one block of one layer.
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.layout.geometry().page_bytes()
    }
    #[getter]
    fn allocations(&self) -> Vec<u64> {
        self.layout.allocations().to_vec()
    }

    /// Raises InvalidArgument saying what is wrong, for a server of
    /// `chunk_tokens`-token chunks.
    fn validate(&self, py: Python<'_>, chunk_tokens: u32) -> PyResult<()> {
        self.layout
            .validate(chunk_tokens)
            .map_err(|e| invalid(py, e.to_string()))
    }

    fn object_bytes(&self, chunk_tokens: u32) -> u64 {
        self.layout.object_bytes(chunk_tokens)
    }

    fn blocks_per_chunk(&self, chunk_tokens: u32) -> u32 {
        self.layout.blocks_per_chunk(chunk_tokens)
    }

    fn __repr__(&self) -> String {
        let g = self.layout.geometry();
        format!(
            "Layout(layers={}, blocks={}, block_tokens={}, heads={}, k_width={}, v_width={}, elem_bytes={}, allocations={:?}{})",
            g.layers,
            g.blocks,
            g.block_tokens,
            g.heads,
            g.k_dim,
            g.v_dim,
            g.elem_bytes,
            self.layout.allocations(),
            self.layout
                .preset_name()
                .map(|p| format!(", preset={p:?}"))
                .unwrap_or_default()
        )
    }
}
