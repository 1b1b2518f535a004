# Summarises a variants.log of scripts/gpu_run.sh (variants): per run its tok/s, step and
# phases_ms, and for runs with --profile the ops whose device time moved most against the first
# profiled run (e.g. one GPU against `--dp 2` against `--dp 2 --skip-comm`).
# Usage: python3 scripts/lab/variants_cmp.py variants.log
import json,re,sys
runs=[]
for l in open(sys.argv[1]):
  if l.startswith('=='): runs.append([l.strip(),None]); continue
  m=re.search(r'^(?:\[rank 0\] )?(\{.*\})\s*$',l)
  if m and runs:
    try: runs[-1][1]=json.loads(m.group(1))
    except Exception: pass
base=None
for name,j in runs:
  if not j: print(name,'(no result)'); continue
  print(name,' tok_s',j['tok_s'],'step',round(j['step_ms'],2),'phases',j.get('phases_ms'))
  p=j.get('profile')
  if not p: continue
  ops={o['op']:o['ms'] for o in p['ops']}
  if base is None: base=ops; print('  profile sum',p['sum_ms'],' '.join(f"{k}:{v}" for k,v in list(ops.items())[:16])); continue
  d=sorted(((ops.get(k,0)-base.get(k,0),k) for k in set(ops)|set(base)),reverse=True)
  print('  profile sum',p['sum_ms'],'diff vs first:',' '.join(f"{k}:{v:+.3f}" for v,k in d[:10]),'...',' '.join(f"{k}:{v:+.3f}" for v,k in d[-4:]))
