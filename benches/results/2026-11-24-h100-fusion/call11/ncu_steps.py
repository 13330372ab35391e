import csv,io,collections,sys
role={0:"q/k/v (+norm, rope, cache)",1:"attention (split)",2:"o + residual",3:"gate/up (+norm, silu)",4:"down + residual"}
d=sys.argv[1]
for shape,L in (("8b",32),("1b",16),("135m",30)):
    try: lines=open(f"{d}/ncu-{shape}.csv").read().splitlines()
    except OSError: continue
    s=next(i for i,l in enumerate(lines) if l.startswith('"ID"'))
    rows=[r for r in csv.DictReader(io.StringIO("\n".join(lines[s:]))) if r["ID"].isdigit()]
    f=lambda r,k: float(r[k].replace(",",""))
    agg=collections.OrderedDict((v,[0,0.0,0.0]) for v in list(role.values())+["output head (+norm)","sample"])
    pos=0
    for j,r in enumerate(rows):
        n=r["Kernel Name"]
        if n=="sample": key="sample"; pos=0
        elif j+1<len(rows) and rows[j+1]["Kernel Name"]=="sample": key="output head (+norm)"
        else: key=role[pos%5]; pos+=1
        a=agg[key]; a[0]+=1; a[1]+=f(r,"gpu__time_duration.sum"); a[2]+=f(r,"dram__bytes_read.sum")
    steps=agg["gate/up (+norm, silu)"][0]/L
    print(f"== {shape}: {steps:.0f} decode steps ({L} layers); ncu, graphs off, caches flushed per kernel")
    print(f"{'part':<28} {'us per step':>11} {'us each':>8} {'GB/s read':>10} {'share':>6}")
    per={}; tot=0
    for k,(c,t,b) in agg.items():
        ps=t/c if k in ("output head (+norm)","sample") else t/steps
        per[k]=(ps,t/c,b/t if t else 0); tot+=ps
    for k,(ps,each,bw) in per.items():
        print(f"{k:<28} {ps/1e3:>11.1f} {each/1e3:>8.2f} {bw:>10.0f} {ps/tot*100:>5.0f}%")
    print(f"{'total':<28} {tot/1e3:>11.1f}")
