import json, glob, sys, statistics as st, collections
d = sys.argv[1]
rows = collections.defaultdict(list)
for f in sorted(glob.glob(d + '/*.json')):
    b, t, pin, i = f.split('/')[-1][:-5].split('-')
    j = json.load(open(f))
    r = j['ratios']
    ratio = r['rpc_sync_p50_over_raw_shm_pingpong_p50'] if t == 'shm' else r['rpc_sync_p50_over_raw_pingpong_p50']
    raw = j['raw_shm_pingpong_p50_us'] if t == 'shm' else j['raw_tcp_pingpong_p50_us']
    rows[(t, pin, b)].append((ratio, j['rpc_sync_p50_us'], raw))
print("| transport | placement | build | runs | ratio median (min..max) | rpc_sync p50 µs median | raw p50 µs median |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for k in sorted(rows):
    v = rows[k]
    rs = [x[0] for x in v]
    print(f"| {k[0]} | {k[1]} | {k[2]} | {len(v)} | {st.median(rs):.2f}x ({min(rs):.2f}..{max(rs):.2f}) | {st.median([x[1] for x in v]):.2f} | {st.median([x[2] for x in v]):.2f} |")
for t in ['tcp','shm']:
    for pin in ['pinned','unpinned']:
        a=[x[1] for x in rows[(t,pin,'base')]]; b=[x[1] for x in rows[(t,pin,'new')]]
        if a and b: print(f"{t} {pin}: new/base rpc_sync p50 = {st.median(b)/st.median(a):.3f}")
