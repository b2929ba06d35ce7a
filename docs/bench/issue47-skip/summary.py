# The idle A/B tables of issue 47 (A and B runs' JSON in the current folder): the one summary
# script; issue47-ar15/ and arena-plans/ run it. Rows and raw keys no run has are left out.
import json, glob, statistics, sys
PRE = sys.argv[1] if len(sys.argv) > 1 else ""
keys = [
 ("2","barrier_w2_over_raw_shm_barrier","barrier / raw shm barrier","<= 1.5"),
 ("2","barrier_w2_over_mpi","barrier / MPICH","<= 0.5"),
 ("2","all_reduce_w2_8B_over_mpi","all_reduce 8 B / MPICH","<= 0.5"),
 ("8","barrier_w8_over_raw_shm_barrier","barrier / raw shm barrier","<= 1.5"),
 ("8","barrier_w8_over_mpi","barrier / MPICH","<= 0.5"),
 ("8","all_reduce_w8_8B_over_mpi","all_reduce 8 B / MPICH","<= 0.5"),
 ("8","all_gather_w8_1MiB_over_mpi","all_gather 1 MiB / MPICH","<= 1"),
 ("8","all_gather_w8_1MiB_over_memcpy","all_gather 1 MiB / memcpy floor","<= 1.3"),
 ("8","all_reduce_w8_1MiB_over_mpi","all_reduce 1 MiB / MPICH","<= 1"),
 ("8","all_reduce_w8_1MiB_over_memcpy","all_reduce 1 MiB / memcpy floor","<= 1.3"),
 ("8","all_gather_w8_1MiB_over_memcpy_all_ranks","all_gather 1 MiB / memcpy of all ranks","<= 1.3"),
 ("8","all_reduce_w8_1MiB_over_memcpy_all_ranks","all_reduce 1 MiB / memcpy of all ranks","<= 1.3"),
 ("8","all_reduce_w8_1MiB_in_place_over_memcpy_all_ranks","all_reduce 1 MiB without the input's copy / memcpy of all ranks","<= 1.3"),
 ("8","all_reduce_w8_1MiB_in_place_over_mpi","all_reduce 1 MiB without the input's copy / MPICH","<= 1"),
 ("2","all_gather_w2_8B_over_mpi","all_gather 8 B / MPICH","-"),
 ("8","all_gather_w8_8B_over_mpi","all_gather 8 B / MPICH","-"),
 ("8","all_gather_w8_1MiB_over_gloo","all_gather 1 MiB / gloo","<= 0.5"),
 ("8","all_reduce_w8_1MiB_over_gloo","all_reduce 1 MiB / gloo","<= 0.5"),
]
raw = ["all_gather_w2_8B_us","all_gather_w8_8B_us","barrier_w2_us","all_reduce_w2_8B_us","raw_shm_barrier_w2_us","mpi_all_reduce_w2_8B_us","all_gather_w8_1MiB_us","mpi_all_gather_w8_1MiB_us","memcpy_w8_all_gather_1MiB_us","memcpy_all_ranks_w8_all_gather_1MiB_us","memcpy_all_ranks_w8_1MiB_us","all_reduce_w8_1MiB_us","all_reduce_w8_1MiB_in_place_us","mpi_all_reduce_w8_1MiB_us","reduce_w8_1MiB_us","reduce_scatter_w8_1MiB_us"]
def med(b, pl, k, r=True):
    vals=[]
    for f in sorted(glob.glob(f"{PRE}{b}-{pl}-*.json")):
        d=json.load(open(f)); src=d.get("ratios",{}) if r else d
        if k in src: vals.append(src[k])
    return (statistics.median(vals), len(vals), vals) if vals else (float('nan'),0,[])
print("| world | ratio | unpinned A | unpinned B | pinned A | pinned B | target |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for w,k,name,t in keys:
    c=[med(b,pl,k) for pl in ("unpinned","pinned") for b in ("A","B")]
    if not any(n for _, n, _ in c):
        continue
    c=[m for m, _, _ in c]
    print(f"| {w} | {name} | " + " | ".join(f"{x:.2f}" for x in c) + f" | {t} |")
print()
for k in raw:
    for pl in ("unpinned","pinned"):
        for b in ("A","B"):
            m,n,v=med(b,pl,k,False)
            if not n:
                continue
            print(f"{k} {pl} {b}: median {m:.2f} of {n}: {[round(x,2) for x in v]}")
