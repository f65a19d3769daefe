"""The retry policy of idempotent bus requests (rlbus.bus.retry): a JetStream answer that is no decision
about the request ("duplicate message id is in process" while a clustered leader still proposes the first
copy) is asked again; an answer that is a decision raises at once. CI met the first as a learner crash
when a cluster server died (tests/test_bus_cluster.py)."""

from __future__ import annotations

import pytest
from nats.js.errors import APIError, BadRequestError

from rlbus.bus.retry import is_retryable, with_retry

IN_PROCESS = {"code": 409, "err_code": 10158, "description": "duplicate message id is in process"}
WRONG_LAST_SEQ = {"code": 400, "err_code": 10071, "description": "wrong last sequence: 5"}


def test_only_answers_that_decide_nothing_are_retryable() -> None:
    assert is_retryable(APIError(**IN_PROCESS))
    assert is_retryable(APIError(code=429, err_code=10167, description="too many requests"))
    assert not is_retryable(BadRequestError(**WRONG_LAST_SEQ))
    assert not is_retryable(APIError(code=409, err_code=10071, description="wrong last sequence"))
    assert not is_retryable(ValueError("a bug, not the server"))


@pytest.mark.timeout(30)
async def test_a_publish_whose_msg_id_is_still_in_process_is_sent_again_until_it_is_acked() -> None:
    answers: list[object] = [APIError(**IN_PROCESS), APIError(**IN_PROCESS), "acked as a duplicate"]
    tries = 0

    async def publish() -> str:
        nonlocal tries
        answer = answers[tries]
        tries += 1
        if isinstance(answer, BaseException):
            raise answer
        return str(answer)

    assert await with_retry("publish prompts", publish) == "acked as a duplicate"
    assert tries == 3


@pytest.mark.timeout(30)
async def test_an_answer_that_decides_raises_on_the_first_try() -> None:
    tries = 0

    async def publish() -> str:
        nonlocal tries
        tries += 1
        raise BadRequestError(**WRONG_LAST_SEQ)

    with pytest.raises(BadRequestError):
        await with_retry("publish prompts", publish)
    assert tries == 1
