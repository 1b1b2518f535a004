import json, sys
for l in open(sys.argv[1]):
    if not l.startswith('{'): continue
    j = json.loads(l); p = j.pop('profile', None)
    print(json.dumps({k: j[k] for k in j if k in ('mode', 'impl', 'peer', 'step_ms', 'tok_s', 'peak_alloc_mib', 'last_loss')}))
    if p: print(' ', p['sum_ms'], ' '.join(f"{o['op']}:{o['ms']}/{o['calls']}" for o in p['ops'][:14]))
