import torch

from common.lm import _attention_with_lse

torch.manual_seed(0)
for n in (45, 99885):
    q = torch.randn(2, 1, 8 * 31, 128, device="cuda", dtype=torch.bfloat16)
    arena = torch.randn(2, n + 7, 128, device="cuda", dtype=torch.bfloat16)
    k = arena[:, :n][:, None]; v = torch.randn_like(k)
    out, lse = _attention_with_lse(q, k, v, 128**-0.5)
    s = (q.float() @ k.float().transpose(-1, -2)) * 128**-0.5
    ref_lse = torch.logsumexp(s, -1); ref = torch.softmax(s, -1) @ v.float()
    print("n", n, "lse err", (lse - ref_lse).abs().max().item(), "out err", (out.float() - ref).abs().max().item())
