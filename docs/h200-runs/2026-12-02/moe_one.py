# one quantised sorted MoE layer at T=64 (26B-A4B shapes), called 6 times: the ncu target
import torch

import perfkit.kernels.moe as M

gen = torch.Generator(device="cuda").manual_seed(0)
gu, dn = M._random_quant_experts("nvfp4", 128, 2816, 704, gen, "cuda")
x, w, idx = M._random_tokens(64, 2816, 128, 8, gen, "cuda")
for _ in range(6):
    M.fused_moe_quantized(x, gu, dn, w, idx, path="sorted")
torch.cuda.synchronize()
print("done")
