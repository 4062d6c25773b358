"""Near-tie models: tiny models whose LM-head columns come in pairs about 1e-6 apart, so the best two logits at every
position are a pair and any difference in rounding (a decode step against its row of a block, a request alone against
the same request in a batch) flips greedy tokens. Used by ``test_exactness.py`` and ``test_server_exactness.py``."""

import torch

from tiny import pair

#: the gap between the two tokens of a pair of LM-head columns, before the final norm's scale
GAP = 1e-6
#: the MLP's width: its down projection sums 512 inputs, where MKL's product of more than 64 rows blocks the sum
#: differently from one row (up to 384 inputs it summed them in order, as our kernel does, on this project's CPU)
INTER = 512
#: tokens generated per greedy request
GREEDY_NEW = 16


def near_tie(model, seed: int = 0):
    """Pair the columns of ``model``'s LM head in place, (d, V) ``weight_t``: column 2j + 1 = column 2j + GAP r_j."""
    w = model.lm_head.weight_t.data
    pairs = w.shape[1] // 2
    r = torch.randn(w.shape[0], pairs, generator=torch.Generator().manual_seed(seed))
    w[:, 1:2 * pairs:2] = w[:, 0:2 * pairs:2] + GAP * r / r.norm(dim=0, keepdim=True)
    return model


def near_tie_pair(vocab: int, seed: int = 0):
    """(target, draft) of ``tiny.pair`` over ``vocab`` tokens with an MLP of width :data:`INTER`, both near ties."""
    target, draft = pair(seed=seed, vocab=vocab, intermediate_size=INTER)
    return near_tie(target, seed), near_tie(draft, seed + 1)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` token ids drawn uniformly from 3..vocab-1 (the non-special ids), seeded."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
