"""`benchmarks.draft_ceiling`'s replay: the speed-up of drafting over plain decoding, worked by hand on
an output that copies its prompt (a step of R rows costs 1 + r (R - 1) one-row steps)."""
from __future__ import annotations

import pytest

from benchmarks.draft_ceiling import replay, walk

PROMPT = list(range(10, 30))  # 20 distinct tokens
COPY = (PROMPT, list(PROMPT))  # the output writes the prompt again


def test_walk_drafts_the_copy_once_its_first_token_is_written():
    # step 1: the prompt's last token appears nowhere before it, no draft; step 2: 16 drafted and right;
    # step 3: the two tokens left (a lookup drafts past them, the output ends)
    assert [(m, emit) for _, _, m, emit in walk([COPY], 16)] == [(0, 1), (16, 17), (2, 2)]


def test_oracle_speed_up_at_one_user():
    # rows 1, 17, 3 against 20 one-row steps
    assert replay([COPY], 16, 0.0, oracle=True) == pytest.approx(20 / 3)
    assert replay([COPY], 16, 0.5, oracle=True) == pytest.approx(20 / (1 + 9 + 2))
    # the prompt's prefill, a step of its 20 rows (1 + 0.5 · 19), on both sides
    assert replay([COPY], 16, 0.5, oracle=True, prefill=True) == pytest.approx((20 + 10.5) / (12 + 10.5))


def test_users_share_each_step_on_both_sides():
    # two copies stepping together: rows 2, 34, 6 against 20 steps of 2 rows
    on = (1 + 0.5 * 1) + (1 + 0.5 * 33) + (1 + 0.5 * 5)
    assert replay([COPY, COPY], 16, 0.5, oracle=True, users=2) == pytest.approx(20 * 1.5 / on)
    # both prompts prefilled in one step of 40 rows
    assert replay([COPY, COPY], 16, 0.5, oracle=True, users=2, prefill=True) == pytest.approx((30 + 20.5) / (on + 20.5))
    # one at a time, the same two outputs give the one-user figure
    assert replay([COPY, COPY], 16, 0.5, oracle=True, users=1) == pytest.approx(20 / 12)
