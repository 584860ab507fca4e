"""A serving schedule for the KV-cache tests, and the incremental run of a layer over it.

Requests (context length, generated tokens, arrival step) join the batch when they have arrived and a
slot is free (prefill: the whole context in one step), then take one token per step until they have
context + generated tokens, and leave. The run feeds each step's new tokens in a qkv_format, as TE's
test_kv_cache.py does, and gathers every new token's output per sequence, for comparison with the
whole sequences run at once under a causal mask.
"""

from collections import OrderedDict

import torch

# (context length, generated tokens, arrival step): different lengths; sequences finish while others
# continue and new ones join in the rows and pages they freed, some after waiting for a free slot.
REQUESTS = [(5, 4, 0), (3, 7, 0), (7, 2, 0), (4, 3, 2), (6, 2, 3), (2, 5, 4), (3, 1, 6)]


def plan(requests, max_batch_size):
    """The steps: each an OrderedDict {seq_id: (tokens cached before, new tokens)}, in batch order."""
    steps, running, waiting, done = [], OrderedDict(), [], {}
    t = 0
    while len(done) < len(requests) or running:
        for seq, (_, _, arrival) in enumerate(requests):
            if arrival == t:
                waiting.append(seq)
        step = OrderedDict((seq, (cached, 1)) for seq, cached in running.items())
        while waiting and len(step) < max_batch_size:
            seq = waiting.pop(0)
            step[seq] = (0, requests[seq][0])
        if step:
            steps.append(step)
        running = OrderedDict()
        for seq, (cached, new) in step.items():
            total = cached + new
            if total < sum(requests[seq][:2]):
                running[seq] = total
            else:
                done[seq] = total
        t += 1
    return steps


def step_dict(step):
    """TE's step_dict of a step: {seq_id: new tokens}."""
    return OrderedDict((seq, new) for seq, (_, new) in step.items())


def step_input(full, step, qkv_format):
    """The step's new tokens of full (one [length, ...] tensor per sequence) in qkv_format (bshd/sbhd padded
    with zeros to the longest step, thd packed)."""
    pieces = [full[seq][cached:cached + new] for seq, (cached, new) in step.items()]
    if qkv_format == "thd":
        return torch.cat(pieces)
    longest = max(p.shape[0] for p in pieces)
    out = pieces[0].new_zeros(len(pieces), longest, *pieces[0].shape[1:])
    for b, piece in enumerate(pieces):
        out[b, :piece.shape[0]] = piece
    return out.transpose(0, 1).contiguous() if qkv_format == "sbhd" else out


def step_output(out, step, qkv_format):
    """{seq_id: the outputs of its new tokens} out of a step's output in qkv_format."""
    found, offset = {}, 0
    for b, (seq, (_, new)) in enumerate(step.items()):
        if qkv_format == "thd":
            found[seq] = out[offset:offset + new]
            offset += new
        else:
            found[seq] = out[b, :new] if qkv_format == "bshd" else out[:new, b]
    return found


def run_incremental(call, inputs, steps, qkv_format, inference_params, on_step=None):
    """Every sequence's outputs, [length, ...] each, from call(*step inputs, inference_params=...) run over
    the steps; on_step(index) runs after each step."""
    outputs = {}
    for index, step in enumerate(steps):
        inference_params.pre_step(step_dict(step))
        out = call(*(step_input(full, step, qkv_format) for full in inputs), inference_params=inference_params)
        for seq, rows in step_output(out, step, qkv_format).items():
            outputs.setdefault(seq, []).append(rows)
        if on_step is not None:
            on_step(index)
    return [torch.cat(outputs[seq]) for seq in sorted(outputs)]
