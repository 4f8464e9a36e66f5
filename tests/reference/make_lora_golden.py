"""Write two PEFT LoRA adapters for tests/data/tiny_llama3/ and what HF transformers + PEFT compute with them:
tests/data/tiny_lora/.

The base is the existing `tiny_llama3` (written by `make_family_golden.py`; read here, never rewritten), loaded in
float32. Each adapter is made with PEFT's own API (`LoraConfig`, `get_peft_model`, `save_pretrained`) and saved in
a sub-folder as PEFT saves it (`adapter_config.json`, `adapter_model.safetensors` in float32; the boilerplate model
card `README.md` that `save_pretrained` also writes is removed):
- `all_modules/`: r 8, lora_alpha 16 (scaling alpha / r = 2) on q/k/v/o_proj and gate/up/down_proj;
- `qv_rslora/`: r 4, lora_alpha 8, use_rslora (scaling alpha / sqrt(r) = 4, where alpha / r would be 2) on q_proj
  and v_proj.
PEFT starts lora_B at zero (an adapter that changes nothing), so every lora_A and lora_B is drawn from a seeded
generator, sized so that scaling * B @ A is about LORA_RELATIVE_SIZE of the base weight it adds to.

`golden.json` holds, for each adapter, `golden_common.record`'s cases on the same 3 prompts as tiny_llama3's own
golden, computed by `PeftModel.from_pretrained(base, folder)` read back from the saved folder (not the in-memory
model) in float32; whether each case's greedy path differs from the base model's; and how far the logprobs move
without the adapter, with rsLoRA's scaling read as alpha / r, and with the weights merged by hand (W + scaling * B @ A,
which PEFT's forward must match within 1e-4).

Run in a separate venv holding torch (CPU), transformers, peft, safetensors and numpy, none of them a Sluice runtime
dependency:

    /tmp/loraref/bin/python tests/reference/make_lora_golden.py \
        [--base tests/data/tiny_llama3] [--out tests/data/tiny_lora]
"""

import argparse
import json
import shutil
import time
from importlib.metadata import version
from pathlib import Path

import torch
from golden_common import GOLDEN_FILE, LOGPROB_DECIMALS, build_golden, greedy, record_cases, write_golden
from make_family_golden import PROMPTS
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

DATA = Path(__file__).resolve().parents[1] / "data"
DEFAULT_BASE = DATA / "tiny_llama3"
DEFAULT_OUT = DATA / "tiny_lora"
BASE_NAME = "tiny_llama3"
# What adapter_config.json names as its base: the folder relative to the repository root, no machine's path.
BASE_MODEL_NAME_OR_PATH = "tests/data/tiny_llama3"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# scaling * B @ A about this fraction of the base weight (elementwise std): enough to move most greedy paths,
# small enough that the model stays an ordinary one (logits of the same order as the base's).
LORA_RELATIVE_SIZE = 0.5

# Each seed the one of 1 to 12 whose greedy paths have the largest smallest top-1/top-2 gap (0.032 and 0.026; the
# others' go down to 3e-4 and 3e-5).
ADAPTERS = {
    "all_modules": dict(
        seed=7, r=8, lora_alpha=16, use_rslora=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "qv_rslora": dict(seed=5, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
}


def scaling(spec: dict) -> float:
    """PEFT's factor on B @ A: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    return spec["lora_alpha"] / (spec["r"] ** 0.5 if spec["use_rslora"] else spec["r"])


def load_base(base: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def randomize_lora(model: PeftModel, spec: dict) -> dict[str, torch.Tensor]:
    """Every lora_A ([r, in]) drawn N(0, s^2 / in) and lora_B ([out, r]) N(0, s^2 / r), in `named_parameters` order
    from one generator seeded spec["seed"], with s^2 = LORA_RELATIVE_SIZE / scaling: each element of scaling * B @ A
    then has a std of LORA_RELATIVE_SIZE / sqrt(in), that fraction of the base weight's 1 / sqrt(in). Returns the
    draws by name, as PEFT saves them (without the adapter's name)."""
    generator = torch.Generator().manual_seed(spec["seed"])
    size = (LORA_RELATIVE_SIZE / scaling(spec)) ** 0.5
    drawn = {}
    for name, param in model.named_parameters():
        if ".lora_A." not in name and ".lora_B." not in name:
            continue
        param.copy_(size * torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)  # [out, in]
        drawn[name.replace(".default.", ".")] = param.detach().clone()
    return drawn


def save_adapter(base: Path, folder: Path, spec: dict) -> dict[str, torch.Tensor]:
    """`spec`'s adapter on a fresh float32 base, randomized and saved into `folder` as PEFT saves it (float32
    weights); returns the weights drawn."""
    config = LoraConfig(
        r=spec["r"], lora_alpha=spec["lora_alpha"], use_rslora=spec["use_rslora"],
        target_modules=spec["target_modules"], lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_base(base), config)
    drawn = randomize_lora(model, spec)
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_NAME_OR_PATH
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder)
    (folder / "README.md").unlink()  # PEFT's model card template: boilerplate only
    # PEFT keeps target_modules as a set, written in an order that changes with Python's string hashing: rewrite it
    # in spec's order, as PEFT writes the file (indent 2, sorted keys), so that a rerun writes the same bytes.
    config_file = folder / "adapter_config.json"
    written = json.loads(config_file.read_text())
    assert sorted(written["target_modules"]) == sorted(spec["target_modules"])
    written["target_modules"] = spec["target_modules"]
    config_file.write_text(json.dumps(written, indent=2, sort_keys=True))
    assert sorted(p.name for p in folder.iterdir()) == sorted(ADAPTER_FILES)
    saved = load_file(folder / "adapter_model.safetensors")
    assert saved.keys() == drawn.keys() and all(torch.equal(saved[k], drawn[k]) for k in drawn), "saved != drawn"
    assert all(t.dtype == torch.float32 for t in saved.values())
    return drawn


@torch.no_grad()
def merged_by_hand(base: Path, folder: Path, spec: dict) -> LlamaForCausalLM:
    """A fresh float32 base whose every targeted weight W is replaced by W + scaling * B @ A, from the saved
    safetensors alone: the arithmetic a server applies, against which PEFT's own forward is checked."""
    model = load_base(base)
    params = dict(model.named_parameters())
    saved = load_file(folder / "adapter_model.safetensors")
    for key in saved:
        if key.endswith(".lora_A.weight"):
            prefix = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = saved[key.replace(".lora_A.", ".lora_B.")]
            params[prefix + ".weight"].add_(scaling(spec) * b @ saved[key])
    return model


def read_adapter(base: Path, folder: Path) -> PeftModel:
    """The adapter read back from `folder` over a fresh float32 base, as anyone else would load it."""
    model = PeftModel.from_pretrained(load_base(base), folder)
    model.eval()
    return model


@torch.no_grad()
def max_logprob_change(a: torch.nn.Module, b: torch.nn.Module, cases: list[dict]) -> float:
    """The largest change of any log-probability over each case's prompt and greedy path between models a and b."""
    change = 0.0
    for case in cases:
        ids = torch.tensor([case["prompt_ids"] + case["greedy_ids"][:-1]])
        la, lb = (torch.log_softmax(m(input_ids=ids).logits[0].float(), dim=-1) for m in (a, b))
        change = max(change, float((la - lb).abs().max()))
    return change


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=DEFAULT_BASE, help="the tiny_llama3 folder (read only)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the folder to write the adapters and "
                        "golden.json into")
    args = parser.parse_args()
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)

    base_model = load_base(args.base)
    base_golden = json.loads((args.base / GOLDEN_FILE).read_text())
    base_greedy = {name: greedy(base_model, ids) for name, ids in PROMPTS.items()}
    assert base_greedy == {c["name"]: c["greedy_ids"] for c in base_golden["cases"]}, "base differs from its golden"

    adapters = {}
    for name, spec in ADAPTERS.items():
        folder = args.out / name
        save_adapter(args.base, folder, spec)
        model = read_adapter(args.base, folder)
        cases = record_cases(model, folder, PROMPTS)
        differs = {c["name"]: c["greedy_ids"] != base_greedy[c["name"]] for c in cases}
        # How far the logprobs move when the adapter is left out, and (rsLoRA) when scaled by alpha / r instead.
        moves = {"without_adapter": max_logprob_change(model, base_model, cases)}
        if spec["use_rslora"]:
            plain = read_adapter(args.base, folder)
            layers = [m for m in plain.modules() if isinstance(getattr(m, "scaling", None), dict)]
            assert len(layers) == 2 * len(spec["target_modules"]) and all(m.scaling == {"default": scaling(spec)}
                                                                          for m in layers)
            for module in layers:
                module.scaling["default"] = spec["lora_alpha"] / spec["r"]
            moves["rslora_read_as_alpha_over_r"] = max_logprob_change(model, plain, cases)
        by_hand = max_logprob_change(model, merged_by_hand(args.base, folder, spec), cases)
        assert by_hand < 1e-4, f"PEFT's forward is not W + scaling * B @ A: {by_hand}"
        moves["weights_merged_by_hand"] = by_hand
        print(f"{name}: greedy differs from the base on {sum(differs.values())} of {len(differs)} cases; "
              + ", ".join(f"max logprob change {k} {v:.3g}" for k, v in moves.items()))
        adapters[name] = {
            "folder": name,
            "r": spec["r"],
            "lora_alpha": spec["lora_alpha"],
            "use_rslora": spec["use_rslora"],
            "scaling": scaling(spec),
            "target_modules": spec["target_modules"],
            "seed": spec["seed"],
            "min_top2_gap": min(c["min_top2_gap"] for c in cases),
            "greedy_differs_from_base": differs,
            "max_logprob_change": {k: round(v, LOGPROB_DECIMALS) for k, v in moves.items()},
            "cases": cases,
        }

    golden = build_golden(base_model, "tests/reference/make_lora_golden.py", [],
                          peft_version=version("peft"), base=BASE_NAME, adapter_weights_dtype="float32")
    golden = {("base_weights_dtype" if k == "weights_dtype" else k): v for k, v in golden.items() if k != "cases"}
    golden["adapters"] = adapters
    write_golden(args.out, golden)
    print(f"took {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
