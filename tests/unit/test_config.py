import pytest

from moe_hang.config import build_config, default_tokens, parse_tokens
from moe_hang.errors import MoeHangError


def test_default_tokens_are_the_reported_ragged_counts():
    assert default_tokens(2) == [68, 401]
    assert default_tokens(3) == [68, 401, 1607]
    assert len(default_tokens(4)) == 4 and len(set(default_tokens(4))) == 4


def test_parse_tokens_accepts_counts_and_zero():
    assert parse_tokens("68,401") == [68, 401]
    assert parse_tokens(" 0 , 5 ") == [0, 5]


@pytest.mark.parametrize("text,needle", [
    ("abc", "not a whole number"), ("68,x", "not a whole number"), ("68,-3", "negative"),
    ("", "expected"), ("68,,401", "expected"), ("1.5,2", "not a whole number"),
])
def test_parse_tokens_rejects_garbage(text, needle):
    with pytest.raises(MoeHangError, match=needle):
        parse_tokens(text)


def test_build_config_defaults():
    cfg = build_config()
    assert (cfg.nproc, cfg.tokens, cfg.model.experts, cfg.model.topk) == (2, [68, 401], 4, 2)
    assert cfg.offsets() == [0, 68]
    assert cfg.total_tokens == 469


def test_nproc_follows_tokens_and_experts_follow_world():
    cfg = build_config(tokens="3,2,0")
    assert cfg.nproc == 3 and cfg.model.experts == 6


@pytest.mark.parametrize("kwargs,needle", [
    ({"nproc": 0}, "at least 1 rank"),
    ({"nproc": 2, "tokens": "1,2,3"}, "3 count"),
    ({"nproc": 4, "tokens": "5,5"}, "2 count"),
    ({"tokens": "0,0"}, "at least one token"),
    ({"experts": 3}, "multiple of the 2 ranks"),
    ({"topk": 5}, "--topk 5"),
    ({"scenario": "nope"}, "unknown scenario"),
    ({"dead_experts": "9"}, "not in 0..3"),
    ({"port": 70000}, "not a TCP port"),
])
def test_build_config_rejects_bad_input(kwargs, needle):
    with pytest.raises(MoeHangError, match=needle):
        build_config(**kwargs)


def test_exit_codes_follow_the_verdict():
    """docs/DESIGN.md §4: 3 when a problem was found (or nothing could be told), 0 when the
    job is fine."""
    from moe_hang.analysis.diagnosis import VERDICTS, exit_code_for

    codes = {v: exit_code_for(v) for v in VERDICTS}
    assert codes == {"desync": 3, "hang": 3, "crash": 3, "rank_died": 3, "inconclusive": 3,
                     "transport_hang": 3, "straggler": 0, "healthy": 0}
