"""What each CUDA IPC driver call costs on this machine, timed alone: the pieces of one
tensorwire IPC transfer (devices-cuda/src/ipc.rs does each of them once per tensor today).

The exporter (this process) makes a legacy IPC handle of a `cuMemAlloc` allocation and an
interprocess event, as `export` does; the importer (a second process, started with
multiprocessing's spawn) opens and closes them, as `import` does, and copies 4 KiB and 256 MiB
out of the opened mapping. Only the CUDA driver (libcuda.so.1, through ctypes) is needed.
Prints one `RESULT {json}` line of medians in microseconds; `SKIPPED: <reason>` and exit 0 where
there is no driver or device. Run by the bundle's run.sh."""

import ctypes
import json
import multiprocessing as mp
import statistics
import sys
import time

MIB = 1 << 20
BIG = 256 * MIB
SMALL = 4096
LAZY_ENABLE_PEER_ACCESS = 1
# CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS, as devices-cuda uses.
IPC_EVENT_FLAGS = 0x2 | 0x4


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def driver():
    cu = ctypes.CDLL("libcuda.so.1")

    def call(name, *args):
        rc = getattr(cu, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} returned CUresult {rc}")

    call("cuInit", 0)
    dev = ctypes.c_int()
    call("cuDeviceGet", ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    call("cuCtxSetCurrent", ctx)
    return call


def alloc(call, n):
    p = ctypes.c_uint64()
    call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(n))
    return p


def median_us(n, f):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def importer(conn):
    try:
        call = driver()
        big_h, small_h, event_h = (Handle.from_buffer_copy(b) for b in conn.recv())
        dst = alloc(call, BIG)
        out = {}

        def open_close(h):
            p = ctypes.c_uint64()
            call("cuIpcOpenMemHandle_v2", ctypes.byref(p), h, LAZY_ENABLE_PEER_ACCESS)
            call("cuIpcCloseMemHandle", p)

        def open_only(h, opened):
            p = ctypes.c_uint64()
            t0 = time.perf_counter()
            call("cuIpcOpenMemHandle_v2", ctypes.byref(p), h, LAZY_ENABLE_PEER_ACCESS)
            opened.append(time.perf_counter() - t0)
            return p

        for name, h in (("big", big_h), ("small", small_h)):
            out[f"open_close_{name}_us"] = median_us(20, lambda h=h: open_close(h))
            opens, closes = [], []
            for _ in range(20):
                p = open_only(h, opens)
                t0 = time.perf_counter()
                call("cuIpcCloseMemHandle", p)
                closes.append(time.perf_counter() - t0)
            out[f"open_{name}_us"] = round(statistics.median(opens) * 1e6, 2)
            out[f"close_{name}_us"] = round(statistics.median(closes) * 1e6, 2)

        def event_open_destroy():
            e = ctypes.c_void_p()
            call("cuIpcOpenEventHandle", ctypes.byref(e), event_h)
            call("cuEventDestroy_v2", e)

        out["event_open_destroy_us"] = median_us(50, event_open_destroy)
        # Copies out of a mapping that stays open (what a cache of opened handles would give).
        for name, h, n in (("small", small_h, SMALL), ("big", big_h, BIG)):
            src = ctypes.c_uint64()
            call("cuIpcOpenMemHandle_v2", ctypes.byref(src), h, LAZY_ENABLE_PEER_ACCESS)

            def copy(src=src, n=n):
                call("cuMemcpyDtoDAsync_v2", dst, src, ctypes.c_size_t(n), None)
                call("cuCtxSynchronize")

            copy()
            out[f"copy_{name}_synced_us"] = median_us(10 if n == BIG else 200, copy)
            call("cuIpcCloseMemHandle", src)
        conn.send(out)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which prints it
        conn.send({"error": f"importer: {e}"})


def main() -> int:
    try:
        call = driver()
    except OSError as e:
        print(f"SKIPPED: no CUDA driver: {e}")
        return 0
    except RuntimeError as e:
        print(f"SKIPPED: no usable CUDA device: {e}")
        return 0
    big, small = alloc(call, BIG), alloc(call, SMALL)
    out = {}

    def get_handle(p):
        h = Handle()
        call("cuIpcGetMemHandle", ctypes.byref(h), p)
        return h

    out["get_mem_handle_big_us"] = median_us(50, lambda: get_handle(big))
    out["get_mem_handle_small_us"] = median_us(50, lambda: get_handle(small))
    same = bytes(get_handle(big)) == bytes(get_handle(big))

    def event_create_record_handle():
        e = ctypes.c_void_p()
        call("cuEventCreate", ctypes.byref(e), IPC_EVENT_FLAGS)
        call("cuEventRecord", e, None)
        h = Handle()
        call("cuIpcGetEventHandle", ctypes.byref(h), e)
        call("cuEventDestroy_v2", e)

    out["event_create_record_handle_destroy_us"] = median_us(50, event_create_record_handle)
    event = ctypes.c_void_p()
    call("cuEventCreate", ctypes.byref(event), IPC_EVENT_FLAGS)
    call("cuEventRecord", event, None)
    event_h = Handle()
    call("cuIpcGetEventHandle", ctypes.byref(event_h), event)
    call("cuCtxSynchronize")

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=importer, args=(child,))
    p.start()
    parent.send([bytes(get_handle(big)), bytes(get_handle(small)), bytes(event_h)])
    if not parent.poll(120):
        p.kill()
        print("FAIL: the importer did not answer within 120 s")
        return 1
    theirs = parent.recv()
    p.join(30)
    if "error" in theirs:
        print(f"FAIL: {theirs['error']}")
        return 1
    out.update(theirs)
    out["same_handle_for_the_same_allocation"] = same
    print("RESULT " + json.dumps(out))
    print("OK ipc driver call costs measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
