"""Float64 torch references for MultiheadAttention and TransformerLayer, reading the modules' weights
by TransformerEngine's parameter names and TransformerEngine's fused-QKV row layout."""

import torch
import torch.nn.functional as F

from activation_reference import activation64


def float64_params(module) -> dict:
    """name -> float64 copy of every parameter (give these requires_grad to get reference grads)."""
    return {n: p.detach().double() for n, p in module.named_parameters()}


def tp_shard_dim(name: str):
    """The dim along which TransformerEngine shards a MultiheadAttention / TransformerLayer / LayerNormMLP
    parameter under tensor parallelism: 0 (rows: column-parallel), 1 (columns: row-parallel) or None
    (replicated)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("proj.weight") or leaf == "fc2_weight":
        return 1
    if leaf.startswith(("query_", "key_", "value_")) or name.endswith(("qkv.weight", "qkv.bias")) \
            or leaf in ("fc1_weight", "fc1_bias"):
        return 0
    return None


def sub(params: dict, prefix: str) -> dict:
    return {n[len(prefix) + 1:]: p for n, p in params.items() if n.startswith(prefix + ".")}


def qkv_weights(mha, P, prefix):
    """(Wq, bq, Wk, bk, Wv, bv) of a self-attention projection, in float64.

    Fused and interleaved: per KV group, its np/ng query heads, its key head, its value head.
    Fused, not interleaved, or split parameters: all query rows, all key rows, all value rows.
    """
    names = P
    np_, ng, hn = mha.num_attention_heads, mha.num_gqa_groups, mha.hidden_size_per_attention_head
    if f"{prefix}.weight" in names:
        w, b = P[f"{prefix}.weight"], P[f"{prefix}.bias"]
        if mha.qkv_weight_interleaved:
            per = np_ // ng
            wg, bg = w.view(ng, per + 2, hn, -1), b.view(ng, per + 2, hn)
            return (wg[:, :per].reshape(np_ * hn, -1), bg[:, :per].reshape(-1), wg[:, per].reshape(ng * hn, -1),
                    bg[:, per].reshape(-1), wg[:, per + 1].reshape(ng * hn, -1), bg[:, per + 1].reshape(-1))
        ws, bs = w.split([np_ * hn, ng * hn, ng * hn]), b.split([np_ * hn, ng * hn, ng * hn])
        return ws[0], bs[0], ws[1], bs[1], ws[2], bs[2]
    return tuple(P[f"{prefix}.{part}_{kind}"] for part in ("query", "key", "value") for kind in ("weight", "bias"))


def norm(x, P, prefix, normalization, eps, zero_centered_gamma=False):
    w = P[f"{prefix}layer_norm_weight"] if prefix is not None else P["weight"]
    if zero_centered_gamma:
        w = w + 1
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    b = P[f"{prefix}layer_norm_bias"] if prefix is not None else P["bias"]
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def rope(t, freqs):
    """Non-interleaved RoPE on [b, s, h, d] as complex rotations of the pairs (t[j], t[j + d2/2])."""
    d2 = freqs.shape[-1]
    half = d2 // 2
    angles = freqs[:t.shape[1], 0, 0, :half].double()  # [s, d2/2]
    z = torch.complex(t[..., :half], t[..., half:d2]) * torch.polar(torch.ones_like(angles), angles)[None, :, None]
    return torch.cat((z.real, z.imag, t[..., d2:]), dim=-1)


def attention(q, k, v, causal):
    """[b, s, h, d] float64 attention with GQA (query head i uses KV head i // (h / g))."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def qk_norm(t, P, name, kind, eps):
    """The per-head q or k norm `name` ("q_norm" / "k_norm") of kind L2Normalization, RMSNorm or LayerNorm."""
    if kind == "L2Normalization":
        return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + eps)
    if kind == "RMSNorm":
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * P[f"{name}.weight"]
    return F.layer_norm(t, (t.shape[-1],), P[f"{name}.weight"], P[f"{name}.bias"], eps)


def mha(module, x, qkv_format="sbhd", causal=True, encoder_output=None, rotary=None, normalization="LayerNorm",
        eps=1e-5, P=None, qk_norm_kind=None, qk_norm_eps=1e-6, qk_norm_before_rope=False):
    """(output without proj bias, proj bias, layernorm output or None) of a MultiheadAttention, in float64."""
    P = float64_params(module) if P is None else P
    to_bshd = (lambda t: t.transpose(0, 1)) if qkv_format == "sbhd" else (lambda t: t)
    x = to_bshd(x.double())
    hn = module.hidden_size_per_attention_head
    ln_out = None
    if module.input_layernorm:
        prefix = "layernorm_qkv." if module.attention_type == "self" else "layernorm_query."
        ln_out = x = norm(x, P, prefix, normalization, eps)
    if module.attention_type == "self":
        prefix = "layernorm_qkv" if module.input_layernorm else "qkv"
        wq, bq, wk, bk, wv, bv = qkv_weights(module, P, prefix)
        kv_in = x
    else:
        prefix = "layernorm_query" if module.input_layernorm else "query_layer"
        key = f"{prefix}.weight" if f"{prefix}.weight" in P else f"{prefix}.query_weight"
        wq, bq = P[key], P[key.replace("weight", "bias")]
        if "key_value.weight" in P:
            w, b = P["key_value.weight"], P["key_value.bias"]
            if module.qkv_weight_interleaved:
                ng = module.num_gqa_groups
                wg, bg = w.view(ng, 2, hn, -1), b.view(ng, 2, hn)
                wk, wv, bk, bv = wg[:, 0].reshape(ng * hn, -1), wg[:, 1].reshape(ng * hn, -1), \
                    bg[:, 0].reshape(-1), bg[:, 1].reshape(-1)
            else:
                (wk, wv), (bk, bv) = w.chunk(2), b.chunk(2)
        else:
            wk, bk = P["key_value.key_weight"], P["key_value.key_bias"]
            wv, bv = P["key_value.value_weight"], P["key_value.value_bias"]
        kv_in = to_bshd(encoder_output.double())
    q = F.linear(x, wq, bq).unflatten(-1, (-1, hn))
    k = F.linear(kv_in, wk, bk).unflatten(-1, (-1, hn))
    v = F.linear(kv_in, wv, bv).unflatten(-1, (-1, hn))
    normed = (lambda q, k: (qk_norm(q, P, "q_norm", qk_norm_kind, qk_norm_eps),  # noqa: E731
                            qk_norm(k, P, "k_norm", qk_norm_kind, qk_norm_eps)))
    if qk_norm_kind is not None and qk_norm_before_rope:
        q, k = normed(q, k)
    if rotary is not None:
        q, k = rope(q, rotary), rope(k, rotary)
    if qk_norm_kind is not None and not qk_norm_before_rope:
        q, k = normed(q, k)
    context = attention(q, k, v, causal).flatten(-2)
    out = F.linear(context, P["proj.weight"])
    back = to_bshd  # the transposition is its own inverse
    return back(out), P["proj.bias"], (back(ln_out) if ln_out is not None else None)


def mlp(module, x, activation="gelu", normalization="LayerNorm", eps=1e-5, P=None):
    """(LayerNormMLP output without fc2 bias, fc2 bias, layernorm output) in float64."""
    P = float64_params(module) if P is None else P
    ln_out = h = norm(x.double(), P, "", normalization, eps)
    h = activation64(F.linear(h, P["fc1_weight"], P["fc1_bias"]), activation)
    return F.linear(h, P["fc2_weight"]), P["fc2_bias"], ln_out


def transformer_layer(layer, x, activation="gelu", normalization="LayerNorm", eps=1e-5, encoder_output=None,
                      P=None):
    """TransformerLayer with dropout 0, in float64: pre-LN residual blocks (or residuals from the
    norm outputs, one shared input for parallel_attention_mlp, a final norm for output_layernorm)."""
    P = float64_params(layer) if P is None else P
    fmt = layer.attn_input_format
    x = x.double()
    post = layer.apply_residual_connection_post_layernorm
    attn, attn_bias, ln = mha(layer.self_attention, x, fmt, causal=True, normalization=normalization, eps=eps,
                              P=sub(P, "self_attention"))
    if layer.parallel_attention_mlp:
        out, bias, _ = mlp(layer.layernorm_mlp, x, activation, normalization, eps, P=sub(P, "layernorm_mlp"))
        return x + attn + attn_bias + out + bias
    h = (ln if post and ln is not None else x) + attn + attn_bias
    if layer.layer_type == "decoder":
        attn, attn_bias, ln = mha(layer.inter_attention, h, fmt, causal=False, encoder_output=encoder_output,
                                  normalization=normalization, eps=eps, P=sub(P, "inter_attention"))
        h = (ln if post else h) + attn + attn_bias
    out, bias, ln = mlp(layer.layernorm_mlp, h, activation, normalization, eps, P=sub(P, "layernorm_mlp"))
    out = (ln if post else h) + out + bias
    if layer.output_layernorm:
        out = norm(out, sub(P, "layernorm"), None, normalization, eps)
    return out


def check_against_reference(module, x, out, reference_fn, tol):
    """out and the grads of x and every parameter against reference_fn(x64, float64 params) and autograd."""
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dy)
    x64 = x.detach().double().requires_grad_()
    P = {n: p.requires_grad_() for n, p in float64_params(module).items()}
    ref_out = reference_fn(x64, P)
    torch.testing.assert_close(out.detach().double(), ref_out.detach(), rtol=tol, atol=tol)
    grads = torch.autograd.grad((ref_out * dy.double()).sum(), [x64] + list(P.values()))
    torch.testing.assert_close(x.grad.double(), grads[0], rtol=tol, atol=tol)
    params = dict(module.named_parameters())
    for name, g in zip(P, grads[1:]):
        torch.testing.assert_close(params[name].grad.double(), g, rtol=tol, atol=tol, msg=name)
