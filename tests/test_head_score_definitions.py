"""The head scores' three definitions and detect_head (issue 40), each checked three ways.

1. Hand-made patterns replace a tiny model's attention, so each cell is known: every definition
   is set against a literal loop over the cells it names, and a few scores against the number
   worked out by hand (ARENA's stripe reads 5/6 where glassgpt's reads 1: it counts the BOS).
2. ARENA's own functions (short excerpts, source named) run on the cache of the same tokens.
3. TransformerLens 4.3's own `head_detector.detect_head` on a TransformerBridge booted over
   the very weights glassgpt imported (tests/test_interp_reference.py's boot).
And the tokens: ARENA's BOS + A + A is taken, a bad prefix or tokens that never repeat are
refused with one InputError. Shapes: B = batch, H = heads, T = positions, n = half, p = prefix.
"""

from __future__ import annotations

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.errors import InputError
from glassgpt.interp import hook_points, run_with_cache
from glassgpt.interp.methods.scores import detect_head, head_scores
from glassgpt.model import GPT

VOCAB, N, P, BATCH = 29, 4, 1, 2
T = P + 2 * N  # 9: BOS + A + A
BOS = 0


def tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32,
                       dropout=0.0)
    return GPT(config).eval()


def bos_a_a(batch: int = BATCH, half: int = N, seed: int = 3) -> torch.Tensor:
    """(batch, 1 + 2 * half): BOS, then a half of distinct non-BOS tokens, twice (distinct, so
    TransformerLens's token-equality patterns have exactly one cell per second-half query)."""
    generator = torch.Generator().manual_seed(seed)
    halves = torch.stack([torch.randperm(VOCAB - 1, generator=generator)[:half] + 1
                          for _ in range(batch)])
    return torch.cat([torch.full((batch, 1), BOS), halves, halves], dim=1)


# --- 1. hand-made patterns ---------------------------------------------------------------------

def one_hot_rows(keys: list[int]) -> torch.Tensor:
    """(T, T): row i attends only to keys[i]."""
    return torch.nn.functional.one_hot(torch.tensor(keys), T).float()


# Each head of layer 0, as a (T, T) pattern; layer 1 has them in the reverse order.
HEADS = {
    "induction": one_hot_rows([i - N + 1 if i >= P + N else 0 for i in range(T)]),
    "uniform": torch.ones(T, T).tril() / torch.arange(1, T + 1).view(T, 1),
    "previous": one_hot_rows([max(i - 1, 0) for i in range(T)]),
    "duplicate": one_hot_rows([i - N if i >= P + N else 0 for i in range(T)]),
}
LAYERS = [list(HEADS.values()), list(HEADS.values())[::-1]]  # L of H (T, T)


@pytest.fixture(scope="module")
def hand_made_scores() -> dict[str, object]:
    """head_scores under each definition, with every layer's pattern replaced by LAYERS."""
    model = tiny()
    points = hook_points(model)
    handles = [points[f"blocks.{layer}.attn.hook_pattern"].register_forward_hook(
                   lambda module, inputs, output, layer=layer:
                   torch.stack(LAYERS[layer]).expand_as(output).clone())
               for layer in range(2)]
    try:
        return {definition: head_scores(model, tokens=bos_a_a(), definition=definition)
                for definition in ("glassgpt", "arena", "transformer_lens")}
    finally:
        for handle in handles:
            handle.remove()


def cells_mean(cells: list[tuple[int, int]]) -> torch.Tensor:
    """(L, H): the mean of each hand-made pattern over `cells`, a literal loop (float64)."""
    return torch.tensor([[sum(float(pattern[i, j]) for i, j in cells) / len(cells)
                          for pattern in layer] for layer in LAYERS], dtype=torch.float64)


def share_on(cells: list[tuple[int, int]]) -> torch.Tensor:
    """(L, H): TransformerLens's "mul": attention on `cells` over all the attention (T rows)."""
    return torch.tensor([[sum(float(pattern[i, j]) for i, j in cells) / float(pattern.sum())
                          for pattern in layer] for layer in LAYERS], dtype=torch.float64)


SECOND_HALF = range(P + N, T)
EXPECTED = {  # definition -> (previous, duplicate, induction), each (L, H)
    "glassgpt": (cells_mean([(i, i - 1) for i in range(1, T)]),
                 cells_mean([(i, i - N) for i in SECOND_HALF]),
                 cells_mean([(i, i - N + 1) for i in SECOND_HALF])),
    # ARENA: pattern.diagonal(offset=-k) is every (i, i - k) with i >= k
    "arena": (cells_mean([(i, i - 1) for i in range(1, T)]),
              cells_mean([(i, i - N) for i in range(N, T)]),
              cells_mean([(i, i - N + 1) for i in range(N - 1, T)])),
    # distinct tokens: TransformerLens's token-equality cells are exactly these
    "transformer_lens": (share_on([(i, i - 1) for i in range(1, T)]),
                         share_on([(i, i - N) for i in SECOND_HALF]),
                         share_on([(i, i - N + 1) for i in SECOND_HALF])),
}


@pytest.mark.parametrize("definition", list(EXPECTED))
def test_each_definition_averages_exactly_the_cells_it_names(hand_made_scores, definition):
    scores = hand_made_scores[definition]
    assert (scores.half, scores.prefix, scores.definition) == (N, P, definition)
    for got, want in zip((scores.previous_token, scores.duplicate_token, scores.induction),
                         EXPECTED[definition], strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-7, rtol=0)


def test_the_definitions_differ_where_worked_out_by_hand(hand_made_scores):
    glass, arena, lens = (hand_made_scores[d] for d in ("glassgpt", "arena", "transformer_lens"))
    # layer 0 head 0 is a perfect induction head (head 3 of layer 1 is the same one)
    assert glass.induction[0, 0] == 1.0 and glass.induction[1, 3] == 1.0
    # ARENA's stripe starts at query n - 1 = 3: (3, 0) is the BOS, read as induction, (4, 1)
    # is not: 5 of its 6 cells
    assert arena.induction[0, 0].item() == pytest.approx(5 / 6, abs=1e-7)
    # TransformerLens's share: 4 induction cells of 9 rows of attention
    assert lens.induction[0, 0].item() == pytest.approx(4 / 9, abs=1e-7)
    assert glass.previous_token[0, 2] == 1.0 and glass.duplicate_token[0, 3] == 1.0
    assert lens.previous_token[0, 2].item() == pytest.approx(8 / 9, abs=1e-7)
    assert glass.duplicate_token[0, 0] == 0.0 and glass.previous_token[0, 0] == 1 / 8


# --- 2. ARENA's functions on the cache of the same tokens --------------------------------------

# ARENA_3.0, chapter1_transformer_interp/exercises/part2_intro_to_mech_interp/solutions.py
# (unchanged but for the store and seq_len passed in, which ARENA keeps as globals).
def arena_induction_score_hook(pattern, hook, seq_len, induction_score_store):
    einops = pytest.importorskip("einops")  # TransformerLens's dependency, not glassgpt's
    induction_stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
    induction_score = einops.reduce(induction_stripe,
                                    "batch head_index position -> head_index", "mean")
    induction_score_store[hook.layer(), :] = induction_score


def arena_prev_attn_score(cache, layer, head):  # prev_attn_detector's score
    attention_pattern = cache["pattern", layer][head]
    return attention_pattern.diagonal(-1).mean()


def test_arena_definition_is_arenas_own_hook_on_the_same_tokens():
    model, tokens = tiny(), bos_a_a(batch=3, half=7)
    _, cache = run_with_cache(model, tokens)
    store = torch.zeros(2, 4)
    points = hook_points(model)
    for layer in range(2):
        name = f"blocks.{layer}.attn.hook_pattern"
        arena_induction_score_hook(cache[name], hook=points[name], seq_len=7,
                                   induction_score_store=store)
    scores = head_scores(model, tokens=tokens, definition="arena")
    torch.testing.assert_close(scores.induction, store, atol=1e-7, rtol=0)
    assert (scores.half, scores.prefix) == (7, 1)
    one = head_scores(model, tokens=tokens[:1], definition="arena")
    _, one_cache = run_with_cache(model, tokens[:1])
    one_cache.remove_batch_dim()  # as ARENA's: (H, T, T) patterns
    want = torch.tensor([[arena_prev_attn_score(one_cache, layer, head) for head in range(4)]
                         for layer in range(2)])
    torch.testing.assert_close(one.previous_token, want, atol=1e-7, rtol=0)
    # on a random model the definitions still read different numbers
    assert not torch.allclose(scores.induction, head_scores(model, tokens=tokens).induction)


# --- 3. TransformerLens's own detect_head ------------------------------------------------------

def lens_detect_head(bridge, rows: torch.Tensor, kind, **options) -> torch.Tensor:
    """TransformerLens's detect_head on each row of ids, passed as a list of 'texts': the tiny
    tokenizer has no vocabulary, so the bridge's to_tokens is handed the ids the text stands for
    (its BOS is the row's own first token)."""
    from transformer_lens.head_detector import detect_head as lens_detect
    texts = [f"row {b}" for b in range(rows.shape[0])]

    def to_tokens(text, **_):  # TransformerLens tokenizes a whole list first, then each text
        return rows if isinstance(text, list) else rows[texts.index(text)].view(1, -1)

    bridge.to_tokens = to_tokens
    seq = texts if rows.shape[0] > 1 else texts[0]
    return lens_detect(bridge, seq, kind, **options)


OPTIONS = [dict(), dict(exclude_bos=True), dict(exclude_current_token=True),
           dict(error_measure="abs"), dict(exclude_bos=True, error_measure="abs"),
           dict(heads=[(0, 1), (1, 0)]), dict(heads={1: [1]}, exclude_current_token=True)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(map(str, o.items())) or "-")
@pytest.mark.parametrize("kind", ["previous_token_head", "duplicate_token_head",
                                  "induction_head"])
def test_detect_head_is_transformer_lens_detect_head(gpt2_and_bridge, kind, options):
    ours, bridge = gpt2_and_bridge
    rows = bos_a_a(batch=2, half=5, seed=5) % 50  # (2, 11), ids of the bridge's vocabulary
    rows[1, 3] = rows[1, 1]  # a token seen twice within the half: several cells in a row
    for seq in (rows[0], rows):  # one sequence, and a batch scored as TransformerLens's list
        want = lens_detect_head(bridge, rows[:1] if seq.dim() == 1 else rows, kind, **options)
        got = detect_head(ours, seq, kind, **options)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_a_custom_pattern_and_a_cache_give_transformer_lens_numbers(gpt2_and_bridge):
    ours, bridge = gpt2_and_bridge
    ids = bos_a_a(batch=1, half=5, seed=6) % 50
    custom = torch.zeros(11, 11)
    custom[:, 0] = 1  # a BOS head
    custom[torch.arange(11), torch.arange(11)] = 1  # and the current token
    want = lens_detect_head(bridge, ids, custom)
    torch.testing.assert_close(detect_head(ours, ids, custom), want, atol=2e-6, rtol=0)
    _, cache = run_with_cache(ours, ids)
    lens_style = {name: t[0] for name, t in cache.items()}  # remove_batch_dim's (H, T, T)
    for given in (cache, lens_style):
        torch.testing.assert_close(detect_head(ours, ids, custom, cache=given), want,
                                   atol=2e-6, rtol=0)
    # head_scores' "transformer_lens" definition is detect_head of each kind, rows averaged
    rows = bos_a_a(batch=2, half=5, seed=7) % 50
    scores = head_scores(ours, tokens=rows, definition="transformer_lens")
    torch.testing.assert_close(scores.induction,
                               lens_detect_head(bridge, rows, "induction_head"),
                               atol=2e-6, rtol=0)


# --- the tokens and the options: taken, or refused by name -------------------------------------

def test_bos_then_a_repeated_half_is_taken_and_its_prefix_found():
    model, tokens = tiny(), bos_a_a()
    found = head_scores(model, tokens=tokens)
    given = head_scores(model, tokens=tokens, prefix=1)
    assert (found.prefix, found.half) == (1, N)
    torch.testing.assert_close(found.induction, given.induction, atol=0, rtol=0)
    assert head_scores(model, tokens=tokens[:, 1:]).prefix == 0  # A + A: no prefix


@pytest.mark.parametrize(("settings", "message"), [
    (dict(tokens=torch.arange(9).view(1, 9)), "do not repeat"),
    (dict(tokens=torch.cat([torch.arange(8).view(1, 8)] * 2, 1)[:, :-1]), "do not repeat"),
    (dict(tokens=bos_a_a(), prefix=2), "after a prefix of 2 do not repeat"),
    (dict(tokens=bos_a_a(), prefix=0), "after a prefix of 0 do not repeat"),
    (dict(tokens=bos_a_a(), prefix=-1), "prefix must be an int"),
    (dict(tokens=bos_a_a(), prefix=True), "prefix must be an int"),
    (dict(prefix=1), "random tokens have none"),
    (dict(definition="tl"), "definition must be one of glassgpt, arena, transformer_lens"),
], ids=["no-repeat", "one-short", "odd-prefix", "no-prefix", "negative", "bool", "random",
        "definition"])
def test_bad_tokens_a_bad_prefix_or_definition_are_refused(settings, message):
    with pytest.raises(InputError, match=message):
        head_scores(tiny(), **settings)


@pytest.mark.parametrize(("args", "options", "message"), [
    (("name_mover_head",), {}, "detection_pattern must be a"),
    (("induction_head",), dict(error_measure="max"), "error_measure must be one of mul, abs"),
    ((torch.ones(9, 9),), {}, "lower triangular"),
    ((torch.ones(8, 8).tril(),), {}, r"must be \(T, T\) for sequences of T = 9"),
    (("induction_head",), dict(heads=[(2, 0)]), "layer 2 does not exist"),
    (("induction_head",), dict(heads={0: [4]}), "head 4 does not exist"),
    (("induction_head",), dict(cache={}), "no hook point 'blocks.0.attn.hook_pattern'"),
])
def test_detect_head_refuses_bad_arguments_by_name(args, options, message):
    with pytest.raises(InputError, match=message):
        detect_head(tiny(), bos_a_a(batch=1), *args, **options)


def test_detect_head_refuses_text_without_a_tokenizer_and_a_cache_of_other_ids():
    model = tiny()
    with pytest.raises(InputError, match="has no to_tokens"):
        detect_head(model, "some text", "induction_head")
    _, cache = run_with_cache(model, bos_a_a(batch=1, seed=4))
    with pytest.raises(InputError, match="other token ids"):
        detect_head(model, bos_a_a(batch=1), "induction_head", cache=cache)
    with pytest.raises(InputError, match="one cache holds one run"):
        detect_head(model, [bos_a_a(batch=1)], "induction_head", cache=cache)
    with pytest.warns(UserWarning, match="other than 0 and 1"):
        detect_head(model, bos_a_a(batch=1), torch.ones(T, T).tril() / 2)


def test_a_hooked_gpt_its_text_and_its_own_cache_give_the_glass_models_numbers():
    from glassgpt.interp import HookedGPT
    from glassgpt.tokenizers import CharTokenizer
    model = tiny()
    hooked = HookedGPT(model, CharTokenizer.from_text("abcdef "))
    text = "abc fed bc fed "  # "a", then "bc fed " twice; a character tokenizer: no BOS
    ids = hooked.to_tokens(text)  # (1, 15)
    want = detect_head(model, ids, "induction_head")
    _, cache = hooked.run_with_cache(text, remove_batch_dim=True)  # (H, T, T) patterns
    for got in (detect_head(hooked, text, "induction_head"),
                detect_head(hooked, text, "induction_head", cache=cache),
                detect_head(model, ids, "induction_head", cache=cache)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    scores = head_scores(hooked, tokens=ids)
    assert (scores.prefix, scores.half) == (1, 7)
    torch.testing.assert_close(scores.induction, head_scores(model, tokens=ids).induction,
                               atol=0, rtol=0)
