"""The one typed config tree every service reads. Field names follow verl where the meaning is the same.

The sections live in `sections.py` (services, bus) and `training.py` (algorithm, actor, trainer, ...)."""

from __future__ import annotations

import re

from pydantic import Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rlbus.config.sections import (
    BusConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    RunConfig,
)
from rlbus.config.training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    KLControlConfig,
    OptimConfig,
    PreferenceConfig,
    TrainerConfig,
)
from rlbus.config.yaml_layer import YamlLayerSource

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "BusConfig",
    "CriticConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "KLControlConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "PreferenceConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RlbusConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
]  # the sections are re-exported


class RlbusConfig(BaseSettings):
    """Root of the tree. Sources, strongest first: command-line overrides, RLBUS_* env vars, the YAML file."""

    model_config = SettingsConfigDict(
        env_prefix="RLBUS_", env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    run: RunConfig = Field(default_factory=RunConfig, description="the run: id, directory, restarts")
    data: DataConfig = Field(
        default_factory=DataConfig, description="prompts: files or a built-in task, lengths, batch size"
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="the policy checkpoint and how it is loaded (dtype, LoRA, packing)",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="the rollout replicas: engine, sampling, placement"
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig,
        description="the reward service: built-in verifier, user function, HTTP or reward model",
    )
    custom_reward_function: CustomRewardFunctionConfig = Field(
        default_factory=CustomRewardFunctionConfig,
        description="verl's custom reward function (file and name)",
    )
    reward_model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="verl's reward model section"
    )
    ref: RefConfig = Field(default_factory=RefConfig, description="the reference-policy service")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="advantage estimator, KL in reward, DAPO filters"
    )
    actor: ActorConfig = Field(
        default_factory=ActorConfig,
        description="the policy update: losses, clipping, micro-batches, optimiser",
    )
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO's value model")
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig,
        description="the learner's loop: steps, validation, checkpoints, weight pushes, loggers",
    )
    bus: BusConfig = Field(
        default_factory=BusConfig, description="NATS: URL, credentials, TLS, JetStream settings"
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="log level and format")
    preference: PreferenceConfig = Field(
        default_factory=PreferenceConfig, description="offline DPO/KTO/SimPO (rlbus train)"
    )
    _inert_keys: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def inert_keys(self) -> dict[str, str]:
        """verl keys the loader accepted without effect here -> why (each a start-up warning)."""
        return self._inert_keys

    @model_validator(mode="after")
    def _run_per_experiment(self) -> RlbusConfig:
        """verl keys checkpoints by experiment: a new trainer.experiment_name is a new run (streams, run dir,
        checkpoints), never a resume of another experiment's state. An explicit run.id wins."""
        if "id" not in self.run.model_fields_set and "experiment_name" in self.trainer.model_fields_set:
            run_id = re.sub(r"[^A-Za-z0-9_-]+", "-", self.trainer.experiment_name).strip("-") or "demo"
            if run_id != self.run.id:
                self.__dict__["run"] = self.run.model_copy(update={"id": run_id})
        return self

    @model_validator(mode="after")
    def _verl_reward_function(self) -> RlbusConfig:
        crf = self.custom_reward_function
        if crf.path is not None:
            spec = f"{crf.path}:{crf.name}"
            if self.reward.type == "http":
                raise ValueError(
                    "custom_reward_function.path and reward.type=http both name the reward: keep one"
                )
            if self.reward.function not in (None, spec):
                raise ValueError(
                    f"custom_reward_function.path and reward.function={self.reward.function} both name "
                    "the reward function: keep one"
                )
            if self.reward.function != spec or self.reward.type != "function":
                self.__dict__["reward"] = self.reward.model_copy(
                    update={
                        "type": "function",
                        "function": spec,
                        "signature": "verl" if self.reward.signature == "auto" else self.reward.signature,
                    }
                )
        return self

    @model_validator(mode="after")
    def _verl_reward_model(self) -> RlbusConfig:
        if self.reward_model.enable and self.reward.type != "model":
            if "type" in self.reward.model_fields_set or self.custom_reward_function.path is not None:
                raise ValueError(
                    f"reward_model.enable=true and reward.type={self.reward.type} both name the reward: keep one"
                )
            self.__dict__["reward"] = self.reward.model_copy(update={"type": "model"})
        if self.reward.type == "model" and not self.reward_model.enable:
            raise ValueError("reward.type=model needs reward_model.enable=true and reward_model.model.path")
        return self

    @model_validator(mode="after")
    def _waits_nest(self) -> RlbusConfig:
        """A replica holding work for a version gives it back before the learner gives up on data."""
        wait = self.rollout.weight_wait_timeout_s
        if wait is not None and wait >= self.trainer.batch_timeout_s:
            raise ValueError(
                f"rollout.weight_wait_timeout_s={wait:g} must be below trainer.batch_timeout_s="
                f"{self.trainer.batch_timeout_s:g}: a replica holding work would make the learner stall first"
            )
        return self

    @property
    def weight_wait_s(self) -> float:
        """How long a replica holds work waiting for its weights (rollout.weight_wait_timeout_s resolved)."""
        wait = self.rollout.weight_wait_timeout_s
        return wait if wait is not None else self.trainer.batch_timeout_s / 2

    @property
    def needs_ref(self) -> bool:
        """The ref service runs only when some KL term needs reference log-probs."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, YamlLayerSource(settings_cls)
