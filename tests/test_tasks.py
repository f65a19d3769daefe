"""Tasks: deterministic, disjoint splits; strict verifiers; countdown never executes its input."""

from __future__ import annotations

import builtins
import json

import pytest

from rlbus.tasks import (
    TASK_NAMES,
    AdditionTask,
    CountdownTask,
    Example,
    Gsm8kTask,
    Task,
    UnsafeExpression,
    extract_answer,
    first_line,
    get_task,
    parse_expression,
)


def test_registry_names_and_types():
    assert set(TASK_NAMES) == {"addition", "countdown", "gsm8k"}
    assert isinstance(get_task("addition"), AdditionTask)
    assert get_task("addition", digits=3).digits == 3
    assert isinstance(get_task("countdown"), CountdownTask)
    assert isinstance(get_task("gsm8k"), Gsm8kTask)
    for name in TASK_NAMES:
        assert isinstance(get_task(name), Task)
        assert get_task(name).name == name
    with pytest.raises(ValueError):
        get_task("nope")


@pytest.mark.parametrize("name", ["addition", "countdown"])
def test_make_examples_deterministic_and_disjoint(name):
    task = get_task(name, digits=2)
    a = task.make_examples("train", 300, seed=3)
    b = task.make_examples("train", 300, seed=3)
    assert a == b
    assert len(a) == 300 and all(isinstance(ex, Example) for ex in a)
    assert task.make_examples("train", 300, seed=4) != a
    train = {ex.prompt for s in range(3) for ex in task.make_examples("train", 500, seed=s)}
    val = {ex.prompt for s in range(3) for ex in task.make_examples("val", 200, seed=s)}
    assert train and val and not (train & val)
    # unique within one call while the split has room
    assert len({ex.prompt for ex in a}) == len(a)
    # the reference answer always scores as correct
    for ex in a[:100]:
        assert task.score(ex.answer, ex.meta) == (1.0, True)
    with pytest.raises(ValueError):
        task.make_examples("test", 3, seed=0)


def test_addition_format_and_strict_scoring():
    task = AdditionTask(digits=2)
    ex = task.example(37, 45)
    assert (ex.prompt, ex.answer) == ("37+45=", "82")
    for ex in task.make_examples("val", 200, seed=0):
        a, b = ex.prompt[:-1].split("+")
        assert len(a) == 2 and len(b) == 2 and ex.answer == str(int(a) + int(b))
    meta = ex.meta
    right = ex.answer
    assert task.score(right, meta) == (1.0, True)
    assert task.score(f" {right}\nanything after the first line", meta) == (1.0, True)
    assert task.score(f"{right}<eos>garbage", meta) == (1.0, True)
    for wrong in ["", "0" + right, right + "0", right + " ", right[:-1], f"{right}.", f"= {right}", "x"]:
        if wrong.strip() == right:
            continue
        assert task.score(wrong, meta) == (0.0, False), wrong
    one = AdditionTask(digits=1)
    assert all(len(ex.prompt) == 4 for ex in one.make_examples("train", 50, seed=0))
    # 1-digit addition has only 100 problems: asking for more repeats rather than hanging
    assert len(one.make_examples("train", 200, seed=0)) == 200


def test_first_line():
    assert first_line(" 12 \n34") == "12"
    assert first_line("12<eos>34") == "12"
    assert first_line("") == ""


def test_countdown_examples_and_scoring():
    task = CountdownTask(digits=1)
    for ex in task.make_examples("train", 200, seed=0):
        nums = ex.meta["numbers"]
        assert len(nums) == 3 and all(1 <= n <= 9 for n in nums)
        assert ex.prompt == f"use {nums[0]} {nums[1]} {nums[2]} to make {ex.meta['target']}:"
        assert ex.meta["target"] >= 1
    meta = {"numbers": [3, 5, 7], "target": 22}
    assert task.score("3*5+7", meta) == (1.0, True)
    assert task.score("(5*3)+7", meta) == (1.0, True)
    assert task.score(" 7 + 3 * 5 \nmore", meta) == (1.0, True)
    assert task.score("3*5+7+0", meta) == (0.0, False)  # extra number
    assert task.score("3*5*7", meta) == (0.0, False)  # wrong value
    assert task.score("22", meta) == (0.0, False)  # numbers not used
    assert task.score("3*5+7+7-7", meta) == (0.0, False)  # a number used twice
    assert task.score("15+7", meta) == (0.0, False)
    assert task.score("", meta) == (0.0, False)
    assert task.score("3*(5+7", meta) == (0.0, False)


def test_parse_expression():
    assert parse_expression("(3+5)*7") == (56, [3, 5, 7])
    assert parse_expression("2-3*4") == (-10, [2, 3, 4])
    for bad in [
        "3/5",
        "3**5",
        "-3+5",
        "3.5+1",
        "a+1",
        "1 2",
        "07+1",
        "()",
        "1" * 100,
        "(" * 40 + "1" + ")" * 40,
    ]:
        with pytest.raises(UnsafeExpression):
            parse_expression(bad)


MALICIOUS = [
    "__import__('os')",
    "__import__('os').system('touch {marker}')",
    "open('{marker}', 'w').write('x')",
    "exec(\"open('{marker}','w')\")",
    "(lambda: 1)()",
    "[x for x in ().__class__.__bases__[0].__subclasses__()]",
    "9**9**9**9",
    "1 if True else 2",
    "3*5+7; import os",
]


def test_countdown_never_executes(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"

    def forbidden(*args, **kwargs):
        raise AssertionError("the verifier must not call eval/exec/compile/__import__")

    task = CountdownTask(digits=1)
    meta = {"numbers": [3, 5, 7], "target": 22}
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    real_import = builtins.__import__
    import_calls: list[str] = []

    def watch_import(name, *args, **kwargs):
        import_calls.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", watch_import)
    for text in MALICIOUS:
        assert task.score(text.format(marker=marker), meta) == (0.0, False), text
    assert task.score("3*5+7", meta) == (1.0, True)
    monkeypatch.undo()
    assert "os" not in import_calls
    assert not marker.exists()


def test_gsm8k_extract_and_score():
    assert extract_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert extract_answer("so the total is 1,234 dollars") == "1,234"
    assert extract_answer("first 3, then \\boxed{42}, finally 7") == "42"
    assert extract_answer("\\boxed{\\frac{1}{2}}") == "1/2"
    assert extract_answer("no number here") is None
    task = Gsm8kTask(method="any")
    meta = {"answer": "1234"}
    assert task.score("The answer is #### 1,234", meta) == (1.0, True)
    assert task.score("... so \\boxed{1234}.", meta) == (1.0, True)
    assert task.score("we get 12 then 1234.00", meta) == (1.0, True)
    assert task.score("we get 1234 then 12", meta) == (0.0, False)
    assert task.score("", meta) == (0.0, False)
    assert task.score("\\boxed{0.5}", {"answer": "1/2"}) == (1.0, True)
    assert task.score("-3", {"answer": "-3"}) == (1.0, True)


def test_gsm8k_strict_and_flexible_read_answers_as_verl_does():
    """verl's gsm8k.compute_score: strict (its default) scores only '#### N', flexible the last number; a
    found but wrong answer scores format_score, none found 0."""
    strict, flexible = Gsm8kTask(format_score=0.1), Gsm8kTask(method="flexible", format_score=0.1)
    meta = {"answer": "72"}
    cases = {  # response: (strict, flexible)
        "48/2 = 24 clips, 48+24 = 72 in all.\n#### 72": (1.0, 1.0),
        "48+24 = 72 in all": (0.0, 1.0),
        "#### 1,072 is wrong": (0.1, 0.1),
        "\\boxed{72}": (0.0, 1.0),
        "#### $72": (0.0, 1.0),  # strict's pattern wants a digit right after '#### '
        "no number": (0.0, 0.0),
        "#### 72" + " pad" * 100: (0.0, 0.0),  # the answer lies before the last 300 characters
    }
    for response, (want_strict, want_flexible) in cases.items():
        assert strict.score(response, meta)[0] == want_strict, response[:40]
        assert flexible.score(response, meta)[0] == want_flexible, response[:40]
    assert strict.score("#### 72", meta) == (1.0, True)


def test_gsm8k_reads_user_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [
        {"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"} for i in range(200)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = get_task("gsm8k", data_path=str(path))
    train = task.make_examples("train", 1000, seed=0)
    val = task.make_examples("val", 1000, seed=0)
    assert len(train) + len(val) == 200 and val
    assert not ({e.prompt for e in train} & {e.prompt for e in val})
    assert task.make_examples("train", 10, seed=1) == task.make_examples("train", 10, seed=1)
    ex = train[0]
    n = int(ex.prompt.split()[2])
    assert ex.answer == str(2 * n)
    assert task.score(f"#### {2 * n}", ex.meta)[1]
    with pytest.raises(ValueError):
        Gsm8kTask().make_examples("train", 1, seed=0)
