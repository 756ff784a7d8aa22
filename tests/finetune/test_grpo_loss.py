"""stage=grpo's pieces in one process: the objective against TRL's GRPOTrainer, the advantages and
rewards against values computed by hand, the rollout seeds (the jobs: tests/finetune/test_grpo.py)."""

from __future__ import annotations

import pytest
import torch

from framework.config.grpo import GRPOConfig
from framework.errors import UserInputError
from framework.finetune.reference import token_logps
from framework.grpo.loss import group_advantages, grpo_loss
from framework.grpo.rewards import Rewards, exact_match, length_reward
from framework.grpo.trainer import rollout_seed, sequences
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


@pytest.mark.parametrize("kl_bias_correction", [True, False])
def test_our_loss_equals_trls_grpo_trainer_loss_on_fixed_completions_and_rewards(tmp_path, kl_bias_correction):
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
    group, temperature, epsilon, beta = 4, 0.7, 0.2, 0.3
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
    ours, stats = grpo_loss(logps, old, ref, advantages, mask, epsilon, beta, kl_bias_correction)
    assert 0 < float(stats["clipped"]) < float(stats["tokens"])  # clipping takes part

    # TRL's inputs: completions right-padded to the longest, each completion-token tensor cut out of ours.
    width = max(len(c) for c in completions)
    completion_ids = torch.zeros((len(completions), width), dtype=torch.long)
    completion_mask = torch.zeros((len(completions), width), dtype=torch.long)
    cut = lambda t: torch.stack([t[j, 2 : 2 + width] for j in range(len(completions))])  # noqa: E731
    for j, c in enumerate(completions):
        completion_ids[j, : len(c)], completion_mask[j, : len(c)] = torch.tensor(c), 1
    assert torch.equal(cut(mask).long(), completion_mask)  # prompt length 3: completion targets start at 2
    args = TRLConfig(
        output_dir=str(tmp_path),
        loss_type="grpo",
        beta=beta,
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
    }
    trl.model.eval()  # no gradient-accumulation scaling of the loss (TRL divides by it in training)
    with torch.no_grad():
        theirs = trl._compute_loss(trl.model, inputs)
    assert abs(ours.item()) > 0.01  # not a loss that is 0 whatever the inputs
    # 1e-5: both take fp32 log-probabilities of the same tokens; TRL's through its fused head.
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)


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
    cfg = GRPOConfig(rewards=["exact_match", "format", "length"], reward_weights=[1.0, 0.5, 2.0], length_target=4)
    scores = Rewards(cfg)(["q", "q"], [" 12", "it is 12!"], [4, 6], ["12", "12"])
    assert scores == [1.0 + 0.5 + 2.0, 1.0 + 0.0 + 2.0 * 0.5]
    assert exact_match("no digits", "3", r"(\d+)") == 0.0
    assert length_reward(20, 4) == 0.0


def test_a_user_reward_needs_its_module_and_function(tmp_path):
    module = (tmp_path / "user_reward").with_suffix(".py")
    module.write_text("def score(prompts, completions, answers):\n    return [len(c) for c in completions]\n")
    cfg = GRPOConfig(rewards=[], reward_module=f"{module}:score", trust_reward_code=True)
    assert Rewards(cfg)(["p"], ["abc"], [2], [""]) == [3.0]
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


def test_rollout_seeds_differ_by_each_of_their_parts():
    seeds = {rollout_seed(s, step, i, k) for s in (0, 1) for step in (1, 2) for i in (0, 1) for k in (0, 1)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
