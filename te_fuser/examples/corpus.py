"""The training corpus shipped with te_fuser, tokenized by bytes.

The text is te_fuser's own project text (its documentation and source code),
written for this project, so it ships without licence questions.
Regenerate it from a checkout with `python -m te_fuser.examples.corpus`.
"""

import os
from pathlib import Path

import torch

CORPUS_PATH = Path(__file__).with_name("data") / "corpus.txt"
VOCAB_SIZE = 256  # one token per byte


def load_tokens() -> torch.Tensor:
    """The corpus as a uint8 tensor of byte tokens."""
    data = CORPUS_PATH.read_bytes()
    if not data:
        raise RuntimeError(f"the training corpus {CORPUS_PATH} is empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Random windows: inputs and next-byte targets, both (seq_len, batch_size) int64 (Megatron's s, b order)."""
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} does not fit in a corpus of {tokens.numel()} tokens")
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = tokens[starts[:, None] + offsets].long().t()
    return windows[:-1].contiguous(), windows[1:].contiguous()


def build_corpus(root: Path, target_bytes: int = 400_000) -> bytes:
    """Concatenate the project's docs and sources (sorted, so the result is reproducible)."""
    suffixes = {".md", ".py", ".c", ".h", ".cu", ".cuh", ".cpp"}
    parts = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.suffix in suffixes and path.is_file() and not any(p.startswith((".", "build")) for p in rel.parts):
            parts.append(f"\n\n# file: {rel}\n\n".encode() + path.read_bytes())
    return b"".join(parts)[:target_bytes]


if __name__ == "__main__":
    repo = Path(os.environ.get("TE_FUSER_REPO", Path(__file__).resolve().parents[2]))
    CORPUS_PATH.parent.mkdir(exist_ok=True)
    CORPUS_PATH.write_bytes(build_corpus(repo))
    print(f"wrote {CORPUS_PATH} ({CORPUS_PATH.stat().st_size} bytes) from {repo}")
