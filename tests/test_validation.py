"""Every rule gives one line naming the key, the value and the fix, before any process starts."""

import pytest
from conftest import compose_config, launch

from launcher.validate import ConfigError, validate

CASES = [
    # (overrides, visible GPUs, words the message must contain)
    (["parallel.dp_replicate_size=0"], 0, ["parallel.dp_replicate_size=0", ">= 1"]),
    (
        ["parallel.dp_replicate_size=3"],
        0,
        ["parallel.dp_replicate_size=3", "does not divide the 4", "1, 2, 4"],
    ),
    (["parallel.cp_size=3"], 0, ["parallel.cp_size=3", "does not divide the world of 4"]),
    (
        ["parallel.cp_size=2", "parallel.dp_shard_size=1"],
        0,
        ["parallel.cp_size=2", "not implemented"],
    ),
    (
        ["parallel.dp_shard_size=4"],
        0,
        ["2 x 4 = 8", "4 ranks will be started", "make the product 4"],
    ),
    (["parallel=hsdp_r2s8_2nodes"], 0, ["parallel.nnodes=2", "parallel.rdzv_endpoint=HOST:PORT"]),
    (["device=cuda"], 2, ["parallel.nproc_per_node=4", "2 GPU(s) are visible"]),
    (["device=cuda"], 0, ["device=cuda", "no GPU is visible"]),
    (["device=tpu"], 0, ["device='tpu'", "auto, cuda, cpu"]),
    (
        ["model.init=pretrained", "model.path=/no/such/model"],
        0,
        ["model.path='/no/such/model'", "does not exist"],
    ),
    (["model.init=pretrained"], 0, ["model.init=pretrained needs model.path"]),
    (["model.init=finetuned"], 0, ["model.init='finetuned'", "pretrained, random"]),
    (
        ["rl.prompts_per_step=6"],
        0,
        ["rl.prompts_per_step=6", "4 data-parallel ranks", "multiple of 4"],
    ),
    (["rl.samples_per_prompt=1"], 0, ["rl.samples_per_prompt=1", ">= 2"]),
    (["rl.clip_low=1.5"], 0, ["rl.clip_low=1.5", "(0, 1)"]),
    (["rl.clip_high=0"], 0, ["rl.clip_high=0", "> 0"]),
    (["rl.temperature=0"], 0, ["rl.temperature=0", "> 0"]),
    (["rl.top_p=1.5"], 0, ["rl.top_p=1.5", "(0, 1]"]),
    (["rl.kl_estimator=k4"], 0, ["rl.kl_estimator='k4'", "k1, k2, k3"]),
    (["rl.loss_agg=sum"], 0, ["rl.loss_agg='sum'", "token_mean"]),
    (["rl.max_new_tokens=0"], 0, ["rl.max_new_tokens=0"]),
    (["rl.decode_spans=9"], 0, ["rl.decode_spans=9", "use 1-8"]),
    (["rl.decode_attention=flash"], 0, ["rl.decode_attention='flash'", "sdpa, triton"]),
    (
        ["rl.decode_attention=triton", "model.arch.head_dim=24"],
        0,
        ["rl.decode_attention=triton", "model.arch.head_dim", "not 24", "rl.decode_attention=sdpa"],
    ),
    (["rl.top_k=-1"], 0, ["rl.top_k=-1", ">= 0"]),
    (["rl.clip_ratio_c=0.5"], 0, ["rl.clip_ratio_c=0.5", "> 1"]),
    (["rl.ratio_level=group"], 0, ["rl.ratio_level='group'", "token, sequence"]),
    (["rl.max_sample_rounds=0"], 0, ["rl.max_sample_rounds=0", ">= 1"]),
    (["rl.overlong_buffer=256"], 0, ["rl.overlong_buffer=256", "rl.max_new_tokens", "at most"]),
    (["rl.rollout_correction=ppo"], 0, ["rl.rollout_correction='ppo'", "none, tis, mis"]),
    (["rl.rollout_is_cap=1"], 0, ["rl.rollout_is_cap=1", "> 1"]),
    (["trainer.eval_k=0"], 0, ["trainer.eval_k=0", ">= 1"]),
    (["data.eval_path=/x.parquet"], 0, ["data.eval_path='/x.parquet'", "data=synthetic"]),
    (["trainer.max_steps=0"], 0, ["trainer.max_steps=0"]),
    (["trainer.hang_timeout_s=5"], 0, ["trainer.hang_timeout_s=5", ">= 30"]),
    (["optim.lr=-1"], 0, ["optim.lr=-1"]),
    (
        ["data=gsm8k", "data.path=/no/such/train.parquet"],
        0,
        ["data.path='/no/such/train.parquet'", "does not exist"],
    ),
    (
        ["data.path=/data/train.parquet"],
        0,
        ["data.path='/data/train.parquet' is ignored by data=synthetic", "data=gsm8k data.path="],
    ),
    (
        ["+data.rewards.not_a_reward=1.0"],
        0,
        ["data.rewards.not_a_reward", "digit_echo", "math_answer"],
    ),
]


@pytest.mark.parametrize("overrides,gpus,words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_rule_message(overrides, gpus, words):
    cfg = compose_config(
        "device=cpu" if gpus == 0 and "device" not in " ".join(overrides) else "device=auto",
        *overrides,
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg, visible_gpus=gpus)
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message


def test_defaults_are_valid(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # gsm8k's default is a hub id
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    validate(compose_config(), visible_gpus=0)
    validate(compose_config("model=qwen3_4b", "model.init=random", "data=gsm8k"), visible_gpus=4)


def test_cli_bad_divisibility_exits_2_with_one_line_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    out = launch(
        "parallel=hsdp_r2s2",
        "parallel.dp_replicate_size=3",
        "device=cpu",
        f"hydra.run.dir={run_dir}",
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "divide" in out.stderr and "parallel.dp_replicate_size=3" in out.stderr
    assert "Traceback" not in out.stderr
    assert not run_dir.exists()  # no run folder, so no worker and no log


def test_cli_bad_value_keeps_an_existing_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    out = launch("rl.temperature=-1", "device=cpu", f"hydra.run.dir={run_dir}")
    assert out.returncode == 2 and "rl.temperature=-1" in out.stderr
    assert (run_dir / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "parallel.dp_replicat_size=2",
            "error: parallel.dp_replicat_size is not a config key; did you mean parallel.dp_replicate_size? "
            "every key is listed in docs/configuration.md",
        ),
        ("parallel.nnodes=abc", "error: parallel.nnodes='abc' is not a valid int"),
        ("trainer.max_steps=3.5", "error: trainer.max_steps=3.5 is not a valid int"),
        (
            "trainer.deterministic=3",
            "error: trainer.deterministic=3 is not a valid bool (true or false)",
        ),
        (
            "model=qwen3_5b",
            "error: model=qwen3_5b is not a preset; did you mean qwen3_4b? choose one of qwen3_0_6b, qwen3_4b, qwen3_tiny",
        ),
        ("rl=ppo", "error: rl=ppo is not a preset; choose one of dapo, dr_grpo, grpo, gspo"),
    ],
)
def test_cli_unknown_keys_wrong_types_and_presets_are_one_line(override, message, tmp_path):
    out = launch(override, "device=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert out.stderr.strip() == message
    assert not (tmp_path / "run").exists()


def test_cli_valid_overrides_pass_the_precheck():
    out = launch(
        "model.path=null",
        "optim.lr=1",
        "rl.clip_high=0.3",
        "+data.rewards.format=1",
        "logger.tags=[a,b]",
        "parallel=hsdp_r1s2,hsdp_r2s1",
        "dry_run=true",
        "-m",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("hsdp-grpo plan:") == 2


@pytest.mark.parametrize(
    "key, other", [("rl.decode_attention", "sdpa"), ("rl.sample_kernel", "torch")]
)
def test_a_triton_kernel_on_a_gpu_without_triton_says_how_to_fix(monkeypatch, key, other):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    cfg = compose_config("parallel=single", "device=cuda", f"{key}=triton")
    with pytest.raises(ConfigError, match=f"Triton is not installed.*{key}={other}"):
        validate(cfg, visible_gpus=1)
    validate(compose_config("device=cpu", f"{key}=triton"), visible_gpus=0)  # unused on CPU


def test_an_uncached_hub_dataset_offline_is_one_line_before_start(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = launch("device=cpu", "data=gsm8k", f"hydra.run.dir={run_dir}", extra_env=offline)
    assert out.returncode == 2 and not run_dir.exists()
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(
        "error: data.path='openai/gsm8k' is a hub dataset that is not in the Hugging Face cache"
    )
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose_config("device=cpu", "data=gsm8k")
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        validate(cfg, visible_gpus=0)
    (tmp_path / "hub" / "datasets--openai--gsm8k" / "snapshots" / "abc").mkdir(parents=True)
    validate(cfg, visible_gpus=0)  # what a download leaves behind: now it passes


def test_a_prompt_too_long_for_the_model_stops_before_the_model_loads(tmp_path):
    """Found in the workers (it needs the tokenizer), before any weights: one line, exit 2."""
    run_dir = tmp_path / "run"
    out = launch("device=cpu", "logger=none", "model.arch.max_position_embeddings=16",
                 "rl.max_new_tokens=12", f"hydra.run.dir={run_dir}")  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "error: rl.max_new_tokens=12: the longest prompt (#0, 5 tokens) plus rl.max_new_tokens is "
        "17 positions, beyond the model's max_position_embeddings=16; lower rl.max_new_tokens to "
        "at most 11 or shorten the prompts"
    )
    assert not (run_dir / "metrics.jsonl").exists()
    assert "build model" not in (run_dir / "logs" / "heartbeats" / "rank_0.json").read_text()
