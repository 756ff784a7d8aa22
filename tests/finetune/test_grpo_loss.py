"""stage=grpo's pieces in one process: the objective against TRL's GRPOTrainer, the advantages and
rewards against values computed by hand, the rollout seeds (the jobs: tests/finetune/test_grpo.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from framework.config.grpo import GRPOConfig
from framework.errors import UserInputError
from framework.finetune.reference import token_logps
from framework.grpo.loss import group_advantages, grpo_loss
from framework.grpo.rewards import Rewards, exact_match, length_reward
from framework.grpo.stage import rollout_seed, sequences
from framework.models.tasks import IGNORE_INDEX


def _tokenizer():
    """A byte-level BPE built here (nothing downloaded)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=120,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([f"{i} plus {j} is {i + j}" for i in range(10) for j in range(10)], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>")


# (loss_type, beta, use_bias_correction_kl, epsilon_high): each loss type at TRL's defaults (beta 0,
# epsilon_high unset: epsilon), DAPO's recommended epsilon_high, and the KL term both ways.
TRL_CASES = {
    "grpo": ("grpo", 0.0, True, None),
    "dapo": ("dapo", 0.0, True, None),
    "dr_grpo": ("dr_grpo", 0.0, True, None),
    "bnpo": ("bnpo", 0.0, True, None),
    "dapo_epsilon_high": ("dapo", 0.0, True, 0.28),
    "grpo_kl": ("grpo", 0.3, True, None),
    "grpo_kl_uncorrected": ("grpo", 0.3, False, None),
    "dapo_kl": ("dapo", 0.3, True, 0.28),
}


@pytest.mark.parametrize("case", sorted(TRL_CASES))
def test_our_loss_equals_trls_grpo_trainer_loss_on_fixed_completions_and_rewards(tmp_path, case):
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    fast = _tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    policy = transformers.LlamaForCausalLM(config).eval()
    reference = transformers.LlamaForCausalLM(config).eval()  # other weights: the KL term is not 0
    loss_type, beta, kl_bias_correction, epsilon_high = TRL_CASES[case]
    group, temperature, epsilon = 4, 0.7, 0.2
    # Two prompts of the same length (TRL's left padding would move positions, ours has none), four
    # completions each of different lengths, their rewards fixed.
    prompts = [[5, 17, 9], [30, 2, 41]]
    completions = [[7, 8, 0], [9], [11, 12, 13, 14], [3, 3], [50, 51], [60, 61, 62], [4], [70, 71, 72, 73]]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0, 1.0, 0.0])
    prompt_ids = [p for p in prompts for _ in range(group)]
    ids, targets = sequences(prompt_ids, completions, pad_id=0)
    mask = targets != IGNORE_INDEX
    advantages = group_advantages(rewards, group)
    with torch.no_grad():
        logps = token_logps(policy, ids, targets, temperature=temperature)
        ref = token_logps(reference, ids, targets, temperature=temperature)
    # The rollout policy's log-probabilities away from the policy's: some ratios leave [0.8, 1.2].
    old = logps + 0.3 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
    width = max(len(c) for c in completions)
    ours, stats = grpo_loss(
        logps,
        old,
        ref,
        advantages,
        mask,
        epsilon,
        beta,
        kl_bias_correction,
        loss_type=loss_type,
        epsilon_high=epsilon_high,
        max_completion_length=width,
        tokens_per_micro_batch=float(mask.sum()),  # one rank, one micro-batch: the batch's tokens
    )
    assert 0 < float(stats["clipped"]) < float(stats["tokens"])  # clipping takes part

    # TRL's inputs: completions right-padded to the longest, each completion-token tensor cut out of ours.
    completion_ids = torch.zeros((len(completions), width), dtype=torch.long)
    completion_mask = torch.zeros((len(completions), width), dtype=torch.long)
    cut = lambda t: torch.stack([t[j, 2 : 2 + width] for j in range(len(completions))])  # noqa: E731
    for j, c in enumerate(completions):
        completion_ids[j, : len(c)], completion_mask[j, : len(c)] = torch.tensor(c), 1
    assert torch.equal(cut(mask).long(), completion_mask)  # prompt length 3: completion targets start at 2
    trl_options = {} if loss_type == "dapo" else {"loss_type": loss_type}  # dapo: TRL's default
    if beta:
        trl_options["beta"] = beta
    if epsilon_high is not None:
        trl_options["epsilon_high"] = epsilon_high
    args = TRLConfig(
        output_dir=str(tmp_path),
        **trl_options,
        epsilon=epsilon,
        temperature=temperature,
        num_generations=group,
        per_device_train_batch_size=group,
        max_completion_length=width,
        report_to="none",
        use_cpu=True,
        bf16=False,
        use_bias_correction_kl=kl_bias_correction,
    )
    # With beta > 0 TRL loads its reference from the policy's name: the reference, saved here.
    if beta:
        reference.save_pretrained(tmp_path / "reference")
        policy.config._name_or_path = str(tmp_path / "reference")
    trl = GRPOTrainer(
        model=policy,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "1 plus 2 is"}] * 8),
        processing_class=fast,
    )
    inputs = {
        "prompt_ids": torch.tensor(prompt_ids),
        "prompt_mask": torch.ones((len(prompt_ids), 3), dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": cut(old) * completion_mask,
        "ref_per_token_logps": cut(ref) * completion_mask,
        "num_items_in_batch": completion_mask.sum(),  # dapo's divisor: the generation batch's tokens
    }
    assert trl.loss_type == loss_type and trl.beta == beta
    assert (trl.ref_model is None) == (beta == 0)  # TRL's default beta=0 loads no reference
    trl.model.eval()  # no gradient-accumulation scaling of the loss (TRL divides by it in training)
    with torch.no_grad():
        theirs = trl._compute_loss(trl.model, inputs)
    assert abs(ours.item()) > 0.01  # not a loss that is 0 whatever the inputs
    # 1e-5: both take fp32 log-probabilities of the same tokens; TRL's through its fused head.
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)


def test_our_defaults_are_trls():
    from trl import GRPOConfig as TRLConfig

    ours, theirs = GRPOConfig(), TRLConfig(output_dir="unused", report_to="none", use_cpu=True)
    assert ours.loss_type.value == theirs.loss_type == "dapo"
    assert ours.beta == theirs.beta == 0.0
    assert ours.scale_rewards == theirs.scale_rewards == "group"
    assert ours.epsilon == theirs.epsilon and ours.epsilon_high is theirs.epsilon_high is None
    assert ours.temperature == theirs.temperature and ours.iterations == theirs.num_iterations
    assert ours.kl_bias_correction == theirs.use_bias_correction_kl
    # TRL's booleans for scale_rewards
    assert GRPOConfig(scale_rewards="true").scale_rewards == "group"
    assert GRPOConfig(scale_rewards="False").scale_rewards == "none"
    with pytest.raises(UserInputError, match="grpo.scale_rewards='sometimes': choose from group, batch, none"):
        GRPOConfig(scale_rewards="sometimes")


def test_advantages_scaled_by_group_batch_or_not_at_all():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0])
    centred = torch.tensor([0.5, -0.5, -1.5, 1.5, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, 2, "none"), centred)
    batch_std = rewards.std()  # TRL's "batch": the std (Bessel's) of every reward of the batch
    torch.testing.assert_close(group_advantages(rewards, 2, "batch", batch_std), centred / (batch_std + 1e-4))


def test_advantages_are_the_groups_normalised_rewards():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0]), 2)
    std = 2**-0.5  # Bessel: two values 1 apart
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]) / (std + 1e-4))


def test_the_loss_by_hand_on_one_completion():
    # ratio e^0.5 = 1.65 with A = 1: clipped to 1.2; kl at ref - logp = -0.5: e^-0.5 + 0.5 - 1.
    logps, old, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, -1.0]]), torch.tensor([[-0.5, -1.0]])
    mask = torch.tensor([[True, False]])
    loss, stats = grpo_loss(logps, old, ref, torch.tensor([1.0]), mask, 0.2, 0.1, kl_bias_correction=False)
    kl = torch.exp(torch.tensor(-0.5)) + 0.5 - 1
    torch.testing.assert_close(loss, -1.2 + 0.1 * kl)
    assert float(stats["clipped"]) == 1.0 and float(stats["tokens"]) == 1.0
    corrected, _ = grpo_loss(logps, old, ref, torch.tensor([1.0]), mask, 0.2, 0.1)  # kl times the ratio e^0.5
    torch.testing.assert_close(corrected, -1.2 + 0.1 * kl * torch.exp(torch.tensor(0.5)))


def test_builtin_rewards_and_weights():
    from framework.grpo.data import Prompt

    cfg = GRPOConfig(rewards=["exact_match", "format", "length"], reward_weights=[1.0, 0.5, 2.0], length_target=4)
    prompts = [Prompt([1], "q", "12")] * 2
    scores = Rewards(cfg)(prompts, [" 12", "it is 12!"], [[5] * 4, [5] * 6])
    assert scores == [1.0 + 0.5 + 2.0, 1.0 + 0.0 + 2.0 * 0.5]
    assert exact_match("no digits", "3", r"(\d+)") == 0.0
    assert length_reward(20, 4) == 0.0


def test_a_user_reward_needs_its_module_and_function(tmp_path):
    from framework.grpo.data import Prompt

    module = (tmp_path / "user_reward").with_suffix(".py")
    module.write_text("def score(completions, **kwargs):\n    return [len(c) for c in completions]\n")
    cfg = GRPOConfig(rewards=[], reward_module=f"{module}:score", trust_reward_code=True)
    assert Rewards(cfg)([Prompt([1], "p", "")], ["abc"], [[7, 8]]) == [3.0]
    with pytest.raises(UserInputError, match="has no function 'nothing'"):
        Rewards(GRPOConfig(rewards=[], reward_module=f"{module}:nothing", trust_reward_code=True))


def test_chat_prompts_need_a_chat_template():
    from framework.data.tokenizer import SFTTokenizer
    from framework.grpo.data import encode_prompt

    fast = _tokenizer()  # no chat template
    record = {"prompt": [{"role": "user", "content": "1 plus 2?"}], "answer": 3}
    with pytest.raises(UserInputError, match="'prompt' holds chat turns but the tokenizer .* has no chat template"):
        encode_prompt(record, SFTTokenizer(None, fast.eos_token_id, hf=fast), "prompt", "answer", True, "f: record 1")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} is{% endif %}"
    )
    prompt = encode_prompt(record, SFTTokenizer(None, fast.eos_token_id, hf=fast), "prompt", "answer", True, "f")
    assert prompt.text == "1 plus 2? is" and prompt.answer == "3"


def test_a_reward_function_gets_trls_arguments_for_plain_and_chat_prompts(tmp_path):
    """As TRL's GRPOTrainer calls one: prompts as given, completions as text or (chat prompts) one
    assistant turn, completion_ids, and every other column by name; what it raises propagates."""
    from framework.grpo.data import Prompt

    module = (tmp_path / "trl_reward").with_suffix(".py")
    module.write_text(
        "seen = []\n"
        "def score(prompts, completions, completion_ids, **kwargs):\n"
        "    seen.append((prompts, completions, completion_ids, kwargs))\n"
        "    if kwargs['level'][0] == 'boom':\n"
        "        raise KeyError('no such level')\n"
        "    return [float(len(ids)) for ids in completion_ids]\n"
    )
    rewards = Rewards(GRPOConfig(rewards=[], reward_module=f"{module}:score", trust_reward_code=True))
    turns = [{"role": "user", "content": "1 plus 2?"}]
    chat = Prompt([1, 2], "1 plus 2? is", "3", record={"prompt": turns, "answer": 3, "level": "easy"})
    plain = Prompt([3], "2 plus 2 is", "4", record={"prompt": "2 plus 2 is", "answer": 4, "level": "hard"})
    assert rewards([chat, plain], [" 3", " 4"], [[9, 0], [8]]) == [2.0, 1.0]
    prompts, completions, ids, kwargs = rewards.user.__globals__["seen"][-1]
    assert prompts == [turns, "2 plus 2 is"]
    assert completions == [[{"role": "assistant", "content": " 3"}], " 4"]
    assert ids == [[9, 0], [8]] and kwargs == {"answer": [3, 4], "level": ["easy", "hard"]}
    boom = Prompt([3], "x", "", record={"prompt": "x", "level": "boom"})
    with pytest.raises(KeyError, match="no such level"):  # the user's own error, not a refusal
        rewards([boom], [" 1"], [[1]])


def test_rollout_seeds_differ_by_each_of_their_parts():
    seeds = {rollout_seed(s, step, i, k) for s in (0, 1) for step in (1, 2) for i in (0, 1) for k in (0, 1)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)


def _trl_advantages(per_func: torch.Tensor, weights: torch.Tensor, group: int, scale: str) -> tuple:
    """TRL 1.16's GRPOTrainer combination (sum_then_normalize) of rewards per function, NaN where a
    function returned None: (the rewards, the advantages)."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
    return rewards, torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)


def test_a_reward_function_returning_none_is_combined_as_trl_combines_it(tmp_path):
    """None is TRL's "not applicable": left out of the weighted sum, and a completion no reward
    applies to is left out of its group's mean and std with advantage 0."""
    from framework.grpo.data import Prompt

    module = (tmp_path / "none_reward").with_suffix(".py")
    module.write_text(
        "def score(completions, **kwargs):\n"
        "    return [None if c.startswith('n') else float(len(c)) for c in completions]\n"
        "def other(completions, **kwargs):\n"
        "    return [None if c.endswith('!') else 0.5 * len(c) for c in completions]\n"
    )
    from framework.grpo.rewards import combine, load_reward_function

    texts = ["n1", "abc", "n!", "x!", "ab", "n2"]  # "n!": neither function applies
    score, other = (load_reward_function(f"{module}:{name}") for name in ("score", "other"))
    columns = [[float("nan") if v is None else v for v in fn(completions=texts)] for fn in (score, other)]
    per_func = torch.tensor(columns).T  # (completions, functions), as TRL's rewards_per_func
    mine = torch.tensor(combine(columns, [1.0, 3.0]))
    for scale in ("group", "batch"):
        theirs, trl_adv = _trl_advantages(per_func, torch.tensor([1.0, 3.0]), 3, scale)
        torch.testing.assert_close(mine, theirs, equal_nan=True)
        batch_std = mine[~torch.isnan(mine)].std() if scale == "batch" else None
        torch.testing.assert_close(group_advantages(mine, 3, scale, batch_std), trl_adv)
    # through Rewards: the built-in format reward (never None) plus the function, its None left out
    cfg = GRPOConfig(rewards=["format"], format_regex="b", reward_module=f"{module}:score", trust_reward_code=True)
    ours = Rewards(dataclasses.replace(cfg, reward_weights=[0.5, 2.0]))
    combined = ours([Prompt([1], "p", "")] * len(texts), texts, [[1]] * len(texts))
    assert torch.isnan(mine[2]) and float(group_advantages(mine, 3)[2]) == 0.0
    # through Rewards: the built-in format reward (no None) plus the function's None left out
    assert combined == [0.5 * 0 + 0.0, 0.5 * 1 + 2.0 * 3, 0.5 * 0, 0.5 * 0 + 2.0 * 2, 0.5 * 1 + 2.0 * 2, 0.0]
    assert ours.last["user"][0] != ours.last["user"][0]  # NaN recorded for the metrics' nanmean


def test_the_batch_std_of_scale_rewards_batch_is_trls():
    """grpo.scale_rewards=batch: the global batch's std, gathered over the ranks (one here), equals
    TRL's nanstd of the batch's rewards, a completion with no reward left out."""
    import types

    import torch.distributed as dist
    from conftest import free_port
    from trl.trainer.utils import nanstd

    from framework.grpo.stage import GRPOObjective

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:  # the group goes with the test: a later in-process group of this worker could not start
        rewards = torch.tensor([0.25, 1.5, -2.0, 3.0, 0.0, 0.75, float("nan"), 2.5])
        rt = types.SimpleNamespace(device=torch.device("cpu"))
        fake = types.SimpleNamespace(rt=rt, dims=types.SimpleNamespace(tp=1, cp=1, pp=1))
        ours = GRPOObjective._batch_std(fake, rewards)
        # float64 sums then float32: within float32 rounding of TRL's float32 two-pass std
        torch.testing.assert_close(ours, nanstd(rewards), rtol=1e-6, atol=1e-6)
        six = GRPOObjective._batch_std(fake, rewards[:6])
        torch.testing.assert_close(six, rewards[:6].std(), rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_a_reward_function_of_the_earlier_form_is_refused_when_loaded(tmp_path):
    from framework.grpo.data import Prompt

    module = (tmp_path / "old_reward").with_suffix(".py")
    module.write_text(
        "def old(prompts, completions, answers):\n    return [0.0] * len(completions)\n"
        "def needs(prompts, completions, completion_ids, level):\n    return [0.0] * len(completions)\n"
    )
    with pytest.raises(UserInputError) as refused:
        Rewards(GRPOConfig(rewards=[], reward_module=f"{module}:old", trust_reward_code=True))
    message = str(refused.value)
    assert message.startswith(f"grpo.reward_module='{module}:old': old(prompts, completions, answers) cannot be")
    assert "fn(prompts, completions, completion_ids, **kwargs)" in message
    assert "fn(prompts, completions, answers) is no longer called" in message and "\n" not in message
    # one that takes no **kwargs: checked against the records' columns on its first call
    rewards = Rewards(GRPOConfig(rewards=[], reward_module=f"{module}:needs", trust_reward_code=True))
    with pytest.raises(UserInputError, match=r"needs\(prompts, completions, completion_ids, level\) cannot be called"):
        rewards([Prompt([1], "p", "", record={"prompt": "p", "answer": 1})], ["x"], [[1]])


def test_a_rollout_past_the_models_positions_is_refused_counting_the_cp_padding():
    """A row holds prompt + completion - 1 tokens, padded under context parallelism to a multiple
    of cp before it is split: a prompt of 10 tokens and 6 new ones fill 15 of 16 positions, which
    cp = 2, 3, 4, 5 and 8 pad to at most 16; cp=6 pads them to 18."""
    import types

    from framework.errors import UserInputError
    from framework.grpo.data import Prompt
    from framework.grpo.stage import GRPOObjective

    def problem(limit: int, cp: int) -> str:
        fake = types.SimpleNamespace(
            model=types.SimpleNamespace(cfg=types.SimpleNamespace(max_seq_len=limit)),
            train_prompts=[Prompt(ids=list(range(10)), text="", answer="")],
            valid_prompts=[],
            cfg=types.SimpleNamespace(grpo=types.SimpleNamespace(max_new_tokens=6)),
            dims=types.SimpleNamespace(cp=cp),
            data=types.SimpleNamespace(vocab_size=100),
        )
        try:
            GRPOObjective._check_positions(fake)
        except UserInputError as exc:
            return str(exc)
        return ""

    assert [problem(16, cp) for cp in (1, 2, 3, 4, 5, 8)] == [""] * 6
    assert problem(16, 6) == (
        "stage=grpo: a prompt of 10 tokens + grpo.max_new_tokens=6 (padded to a multiple of parallelism.cp=6) "
        "exceed the model's 16 positions; lower grpo.max_new_tokens or shorten the prompts"
    )
    assert problem(15, 1) == (
        "stage=grpo: a prompt of 10 tokens + grpo.max_new_tokens=6 exceed the model's 15 positions; lower "
        "grpo.max_new_tokens or shorten the prompts"
    )
