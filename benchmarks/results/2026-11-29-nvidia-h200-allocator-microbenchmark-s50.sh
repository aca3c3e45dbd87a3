cat > /tmp/a.py <<'E'
import torch,time,random
T=torch.cuda;M=2**20;d='cuda';U=torch.uint8;P=time.perf_counter
def st():
 s=T.memory_stats();return [s.get(k,0) for k in('num_device_alloc','num_device_free','num_alloc_retries','num_sync_all_streams')]+[s['reserved_bytes.all.current']>>20]
def E(n):return torch.empty(n,dtype=U,device=d)
E(1);T.synchronize()
for k in range(2):
 t=P();L=[E(20*M) for _ in range(200)];T.synchronize();print('alloc20M_us',k,(P()-t)/200*1e6);del L
t=P();T.empty_cache();print('empty_cache_ms',(P()-t)*1e3)
random.seed(0);S=[random.randint(1,64)*M//4 for _ in range(64)];L=[None]*16
for k in range(2):
 t=P()
 for i in range(20000):L[i%16]=E(S[i%64])
 T.synchronize();print('mixed_malloc_free_us',(P()-t)/20000*1e6)
del L
s2=T.Stream();H=[torch.empty(16*M,dtype=U,pin_memory=True) for _ in range(36)]
def step():
 c=T.current_stream()
 for i in range(36):
  a=E(16*M);a.fill_(1);w=E(48*M);s2.wait_stream(c)
  with T.stream(s2):H[i].copy_(a,non_blocking=True)
  a.record_stream(s2);del a,w
 for i in reversed(range(36)):
  r=E(16*M);s2.wait_stream(c)
  with T.stream(s2):r.copy_(H[i],non_blocking=True)
  c.wait_stream(s2);g=E(48*M);g.copy_(r.repeat(3));del r,g
for k in range(3):step()
T.synchronize();a0=st();t=P()
for k in range(20):step()
T.synchronize();print('step_ms',(P()-t)/20*1e3,'delta20',[b-a for a,b in zip(a0,st())],'now',st())
t=P();T.empty_cache();step();T.synchronize();print('empty+step_ms',(P()-t)*1e3,st())
t=P();step();T.synchronize();print('next_step_ms',(P()-t)*1e3)
a=E(256*M);h=torch.empty(256*M,dtype=U,pin_memory=True)
for n in(0,1):
 T.synchronize();t=P()
 for _ in range(10):a.copy_(h,non_blocking=True) if n else h.copy_(a,non_blocking=True)
 T.synchronize();print('h2d' if n else 'd2h','GB/s',256*M*10/(P()-t)/1e9)
E
for c in "" "expandable_segments:True";do echo "== conf=$c";PYTORCH_CUDA_ALLOC_CONF=$c python3 /tmp/a.py;done
