import json,subprocess,os,sys,math
model=sys.argv[1]; ref=sys.argv[2]
r=json.load(open(ref))
cfgs={}
for a in sys.argv[3:]:
    cfgs[a]=dict(kv.split('=') for kv in a.split(',') if kv)
for name,e in cfgs.items():
    env=dict(os.environ,**e)
    d1=[];dm=[];dme=[];agree=0;tot=0;firm_miss=[]
    for c in r['cases']:
        out=subprocess.run([os.environ.get('CAIRN_SCORE_BIN','target/debug/cairn'),'score','--backend','cpu','--model',model,'--prompt-ids',','.join(map(str,c['prompt_tokens'])),'--continuation-ids',','.join(map(str,c['continuation'])),'--json'],env=env,capture_output=True,text=True)
        g=json.loads(out.stdout)
        for i,(t,l) in enumerate(zip(g['top1'],g['top2_logits'])):
            tot+=1
            w=c['top1'][i]; ex=c.get('exact_top1',c['top1'])[i]
            agree+= (t==w or t==ex)
            firm=c['margin'][i]>=0.3 and (('exact_top1' not in c) or (c['exact_top1'][i]==w and c['exact_margin'][i]>=0.3))
            if firm and t!=w: firm_miss.append((c['name'],i,round(c['margin'][i],2),round(l[0]-l[1],3)))
            if t==w:
                d1.append(l[0]-c['top2_logits'][i][0]); dm.append((l[0]-l[1])-c['margin'][i])
                if 'exact_top1' in c and c['exact_top1'][i]==w: dme.append((l[0]-l[1])-c['exact_margin'][i])
    rms=lambda v: math.sqrt(sum(x*x for x in v)/len(v))
    print(f"{name:45s} agree {agree}/{tot} firm misses {firm_miss} | rms top1-logit vs llama {rms(d1):.3f}, margin vs llama q8 {rms(dm):.3f}, margin vs llama f32 {rms(dme) if dme else 0:.3f}",flush=True)
