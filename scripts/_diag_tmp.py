import time, torch
from offload.policies import hardware as h
for comp in (False, True):
    print("profile rate", comp, h._cpu_attention_rate(torch.float16, compressed=comp))
