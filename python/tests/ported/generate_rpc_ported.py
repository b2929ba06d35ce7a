"""Generates ``python/tests/rpc_ported_bodies.py`` from the installed torch's
``torch/testing/_internal/distributed/rpc/rpc_test.py``: the module's helpers and the tests of
``RpcTestCommon`` and ``RpcTest`` that use only the RPC API and a gloo process group (the others,
and those ``rpc_ported_patches.NOT_PORTED`` names, are listed with the reason as
``NOT_PORTED``), with the changes of ``rpc_ported_patches.py`` applied and listed as
``PORTED``. Run: ``python python/tests/ported/generate_rpc_ported.py``."""
import ast, importlib.util, json, os, re, sys
from collections import Counter

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(torch.__file__), "testing/_internal/distributed/rpc/rpc_test.py")
text = open(SRC).read()
lines = text.splitlines(keepends=True)
tree = ast.parse(text)

def seg(node):
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    return "".join(lines[start - 1:node.end_lineno])

# Reasons a test body is not ported (it needs a part of torch.distributed.rpc that is not RPC's API).
OUT_OF_SCOPE = [
    (r"profil|record_function|_build_rpc_profiling_key|get_function_event", "the profiler integration of torch's C++ agent"),
    (r"torch\.jit|script|heavy_rpc_torchscript", "TorchScript RPC (torch's C++ agent)"),
    (r"mock\.|backend_registry|_use_rpc_pickler|_internal_rpc_pickler|PythonUDF|_thread_local_var|MyPickleClass|_init_rpc_backend", "a private torch.distributed.rpc internal (pickler, backend registry, mocks)"),
    (r"_get_current_rpc_agent|rpc\.api\.(?!get_worker_info\()|_delete_all_user_and_unforked_owner_rrefs|_ignore_rref_leak|_is_current_rpc_agent_set", "a private torch.distributed.rpc internal (the agent object, api module state)"),
    (r"_barrier\(|_all_gather\(|_wait_all_workers|_wait_all\(", "a private torch.distributed.rpc collective (_barrier, _all_gather, _wait_all)"),
    (r"wait_until_|_get_type\(|_rref_type", "a private RRef/agent internal (_get_type, owner/fork counts)"),
    (r"_get_debug_info|_rref_context_get_debug_info|get_debug_info", "torch's agent debug counters"),
    (r"cuda|gpu", "CUDA (no GPU here; the Python layer carries CPU tensors)"),
]

spec = importlib.util.spec_from_file_location("patches", os.path.join(HERE, "rpc_ported_patches.py"))
P = importlib.util.module_from_spec(spec); spec.loader.exec_module(P)

out = {"helpers": [], "tests": [], "skipped": {}}
helpers = {}
tests = []
for node in tree.body:
    if isinstance(node, ast.ClassDef) and node.name in ("RpcTestCommon", "RpcTest"):
        for f in node.body:
            if not isinstance(f, ast.FunctionDef):
                continue
            if f.name.startswith("test_"):
                tests.append((node.name, f.name, seg(f)))
            else:
                helpers[f.name] = (node.name, f.name, seg(f))

def closure(src, acc):
    for name in re.findall(r"(?:self|RpcTest|RpcTestCommon)\.(\w+)", src):
        if name in helpers and name not in acc:
            acc.add(name)
            closure(helpers[name][2], acc)
    return acc

used = set()
for cls, name, src in tests:
    deps = closure(src, set())
    full = src + "".join(helpers[d][2] for d in deps)
    reason = next((r for pat, r in OUT_OF_SCOPE if re.search(pat, full)), P.NOT_PORTED.get(name))
    if reason:
        out["skipped"][f"{cls}.{name}"] = reason
        continue
    out["tests"].append((cls, name, src))
    used |= deps
out["helpers"] = [helpers[h] for h in helpers if h in used]
data = out

DROP_MODULE = {"load_tests", "StubRpcAgent", "_stub_construct_rpc_backend_options_handler", "_stub_init_rpc_backend_handler"}
module_parts = []
seen_first = False
for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
    if isinstance(node, ast.ClassDef) and node.name in ("RpcTestCommon", "RpcTest", "CudaRpcTest", "TensorPipeAgentRpcTest", "TensorPipeAgentCudaRpcTest"):
        continue
    names = {getattr(node, "name", None)} | {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
    if names & DROP_MODULE:
        continue
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        continue
    module_parts.append(seg(node))

out = []
out.append(P.HEADER)
out.append("\n\n".join(module_parts))
out.append("\n\nclass RpcTest(RpcAgentTestFixture):\n")
status = {}
for cls, name, src in data["helpers"]:
    out.append("\n" + src)
for cls, name, src in data["tests"]:
    reasons = []
    for old, new, why in P.PATCHES.get(name, []):
        if old is not None:
            assert old in src, (name, old)
            src = src.replace(old, new)
        reasons.append(why)
    status[name] = ("changed: " + "; ".join(reasons)) if reasons else "unchanged"
    out.append(f"\n    # PyTorch: {cls}.{name}\n" + src)
out.append(P.FOOTER)
out.append("\n\n#: Each ported test: unchanged, or changed (and why).\nPORTED = " + repr(status) + "\n")
out.append("\n#: PyTorch's tests of RpcTestCommon and RpcTest not ported, and why.\nNOT_PORTED = " + repr(data["skipped"]) + "\n")
open(os.path.join(os.path.dirname(HERE), "rpc_ported_bodies.py"), "w").write("".join(out))
print(Counter(data["skipped"].values()))
print(sum(v == "unchanged" for v in status.values()), "unchanged", sum(v != "unchanged" for v in status.values()), "changed")
