"""(See solo_tw.py.) Wraps named functions of tensorwire's Python layer with perf_counter_ns accumulators (inclusive time, calls)."""
import functools, json, os, time
TOTALS = {}
_RESET = []
def _wrap(mod, name):
    f = getattr(mod, name)
    key = f"{mod.__name__.rsplit('.',1)[-1]}.{name}"
    acc = TOTALS.setdefault(key, [0, 0])
    pc = time.thread_time_ns if os.environ.get('TW_CLOCK') == 'cpu' else time.perf_counter_ns
    @functools.wraps(f)
    def w(*a, **k):
        t = pc()
        try:
            return f(*a, **k)
        finally:
            acc[0] += pc() - t; acc[1] += 1
    setattr(mod, name, w)
def install():
    from tensorwire.rpc import _autograd_engine as E, _serialize as S, dist_autograd as D
    import tensorwire.rpc as R
    for n in ("import_tensor", "export_tensor", "receive", "backward", "_relayed", "_leaves", "_grads",
              "_has_node_hooks", "_prepare_call", "_decode", "dumps_split", "serve", "owner_call", "merge",
              "_run_in", "_owned_gradient", "_captured"):
        _wrap(E, n)
    for n in ("check_carried", "loads", "dumps", "dumps_flat", "_prepare"):
        _wrap(S, n)
    for n in ("_invoke", "_returned", "_decoded", "_bind", "_function_name", "_worker_name"):
        if hasattr(R, n): _wrap(R, n)
    if os.environ.get("TW_PROBE"):
        install_probe()
def reset_all():
    for v in TOTALS.values(): v[0] = 0; v[1] = 0
def dump(rank):
    out = os.environ.get("TW_OUT", "tw")
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(TOTALS, f)

def install_lines():
    """import_tensor with its lines timed (dense path only)."""
    import math, torch
    from tensorwire.rpc import _autograd_engine as E, _serialize as S
    pc = time.thread_time_ns if os.environ.get('TW_CLOCK') == 'cpu' else time.perf_counter_ns
    names = ["frombuffer", "numel/prod", "set_", "mark"]
    accs = [TOTALS.setdefault("line." + n, [0, 0]) for n in names]
    orig = E.import_tensor
    def import_tensor(dtype, shape, buffer, requires_grad):
        if dtype == "uint8" or len(buffer) == 0:
            return orig(dtype, shape, buffer, requires_grad)
        t0 = pc()
        dt = S._DTYPES[dtype]
        t = torch.frombuffer(buffer, dtype=dt)
        t1 = pc()
        if t.numel() != math.prod(shape):
            raise ValueError("x")
        t2 = pc()
        t.set_(t.untyped_storage(), 0, shape)
        t3 = pc()
        if requires_grad:
            t._tensorwire_received = True
        t4 = pc()
        for a, d in zip(accs, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            a[0] += d; a[1] += 1
        return t
    E.import_tensor = import_tensor

def install_probe():
    """(TW_PROBE=1, eighteenth round) What one more entry from native code into Python costs
    inside the step: at every ``import_tensor`` and ``export_tensor`` call (the entries a fused
    serve/backward would save), a no-op Python function of four arguments called from C
    (``map``), timed by the thread's CPU clock, and an empty interval of the same clock to
    subtract. ``probe.entry`` minus ``probe.empty`` per call is an entry's own cost, cold as the
    step leaves it."""
    from tensorwire.rpc import _autograd_engine as E
    pc = time.thread_time_ns
    empty = TOTALS.setdefault("probe.empty", [0, 0])
    entry = TOTALS.setdefault("probe.entry", [0, 0])
    def _noop(a, b, c, d):
        return a
    args = ((None,), (None,), (None,), (None,))
    def probe():
        t0 = pc(); t1 = pc()
        empty[0] += t1 - t0; empty[1] += 1
        t0 = pc()
        for _ in map(_noop, *args):
            pass
        t1 = pc()
        entry[0] += t1 - t0; entry[1] += 1
    for name in ("import_tensor", "export_tensor"):
        f = getattr(E, name)
        def w(*a, _f=f, **k):
            probe()
            return _f(*a, **k)
        setattr(E, name, w)
