"""A peft adapter checkpoint's parameters, from its ``adapter_config.json`` and the base model's definition.

A Trainer checkpoint of a LoRA / QLoRA run holds ``adapter_model.safetensors`` and
``adapter_config.json``, no ``config.json`` (names-and-layouts.md §7). Its optimizer holds the
trainable parameters of the *wrapped* model, in its ``named_parameters()`` order, in Trainer's
decay / no-decay groups; the adapter file stores them sorted and without the adapter name. What
fixes the order is the base model's module tree with peft's modules inserted, so statekit builds
exactly that: the base model (``base_model_name_or_path``'s ``config.json`` — a local folder, else
the local Hugging Face cache, never the network — or ``--model-config``) on the meta device,
wrapped by peft itself with the saved config (LoRA and DoRA's magnitude, ``modules_to_save``,
``trainable_token_indices``, and any other tuner peft ships), under the adapter's own name
(``default`` at the top, another in a sub-folder named after it; a folder of several adapters is
refused: which of them trained is in no file). Positions are named
as that model's ``named_parameters()`` names them, adapter name included
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``).

Before any name is used, peft's own ``get_peft_model_state_dict`` of the wrapped model must give
exactly the adapter file's names and shapes, adapter by adapter; any difference is refused naming
the tensor. Layouts come from the wrapped model like any other (:mod:`hf_model`): LoRA's A and B
are ``nn.Linear`` weights. peft is imported here only; without it one line names the extra.
"""

from __future__ import annotations

import json
import os

from statekit import clients
from statekit.errors import MappingError
from statekit.frameworks import hf_model

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
INSTALL = "pip install 'statekit[peft]'"


def adapter_folders(path: str) -> dict[str, str]:
    """The adapters a checkpoint folder (or the folder of a file in it) holds: ``{name: folder}``,
    ``default`` at the top, others in sub-folders named after them (peft's ``save_pretrained``)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    out: dict[str, str] = {}
    if os.path.isfile(os.path.join(folder, CONFIG)):
        out["default"] = folder
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return out
    for entry in entries:
        sub = os.path.join(folder, entry)
        if entry != "default" and os.path.isfile(os.path.join(sub, CONFIG)):
            out[entry] = sub
    return out


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise MappingError(f"cannot read the adapter config: {exc.strerror}", path) from None
    except ValueError as exc:
        raise MappingError(f"the adapter config is not JSON: {exc}", path) from None
    if not isinstance(data, dict) or not isinstance(data.get("peft_type"), str):
        raise MappingError("is not a peft adapter config (no peft_type)", path)
    return data


def hub_cache() -> str:
    """The Hugging Face hub cache as huggingface_hub finds it, read from the environment now."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def base_config(adapter: dict, config_path: str) -> tuple[str, str]:
    """``(config.json of the base model, where it was found)`` for an adapter config: its
    ``base_model_name_or_path`` as a local folder (absolute, or relative to the current folder or to
    one holding the checkpoint: where the training ran), else that hub id in the local Hugging Face
    cache. Never the network; a MappingError says to give ``--model-config`` otherwise."""
    name = adapter.get("base_model_name_or_path")
    if not isinstance(name, str) or not name.strip():
        raise MappingError("names no base model (base_model_name_or_path is empty: the model was built in memory); "
                           "give the base model's config.json with --model-config", config_path)
    folders = [name]  # absolute, or relative to the current folder
    if not os.path.isabs(name):
        here = os.path.dirname(os.path.abspath(config_path))
        while True:
            folders.append(os.path.join(here, name))
            parent = os.path.dirname(here)
            if parent == here:
                break
            here = parent
    for folder in folders:
        candidate = os.path.join(folder, hf_model.CONFIG)
        if os.path.isfile(candidate):
            return candidate, f"{name!r}: a local folder"
    cache = hub_cache()
    revision = adapter.get("revision") if isinstance(adapter.get("revision"), str) else None
    found = None
    if name.count("/") <= 1 and not name.startswith((".", "/")):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover - transformers depends on it
            try_to_load_from_cache = None
        if try_to_load_from_cache is not None:
            try:
                found = try_to_load_from_cache(name, hf_model.CONFIG, cache_dir=cache, revision=revision)
            except Exception:  # noqa: BLE001 - a name the hub would not accept is simply not in the cache
                found = None
    if isinstance(found, str) and os.path.isfile(found):
        return found, f"{name!r}: found in the local Hugging Face cache"
    raise MappingError(f"its base model {name!r} is neither a local folder with a config.json nor in the local "
                       f"Hugging Face cache ({cache}); statekit never downloads: give the base model's config.json "
                       "with --model-config", config_path)


def _import():
    try:
        with clients.quiet("importing peft"):  # and what it imports: accelerate, bitsandbytes where installed
            import peft
    except ImportError:
        raise hf_model.MissingDefinitionError(
            f"naming a peft adapter checkpoint's positions needs peft: {INSTALL}, or give --names FILE "
            "(the wrapped model's named_parameters() order)") from None
    return peft


def build(path: str, *, model_config: str | None = None, trust_remote_code: bool = False) -> hf_model.Definition:
    """The wrapped model of the adapter checkpoint at ``path`` (a folder, or a file in it)."""
    adapters = adapter_folders(path)
    if not adapters:
        raise MappingError(f"holds no peft {CONFIG}", path)
    if len(adapters) > 1:  # peft saves every adapter; which of them the run trained is in no file
        raise MappingError(f"holds {len(adapters)} peft adapters ({', '.join(repr(n) for n in adapters)}); which of "
                           "them the run trained is recorded nowhere in the checkpoint: give --names FILE listing the "
                           "optimizer's parameters (the wrapped model's named_parameters() names)", path)
    first = next(iter(adapters.values()))
    first_config = os.path.join(first, CONFIG)
    raw = {name: _read(os.path.join(folder, CONFIG)) for name, folder in adapters.items()}
    if model_config is not None:
        base, found = model_config, "given by --model-config"
    else:
        base, found = base_config(next(iter(raw.values())), first_config)
    peft = _import()
    configs = {}
    for name, folder in adapters.items():
        with clients.quiet(f"peft reading {CONFIG}"):
            try:
                cfg = peft.PeftConfig.from_pretrained(folder)
            except Exception as exc:  # noqa: BLE001 - peft's own reading of its file
                raise MappingError(f"peft {peft.__version__} cannot read it ({type(exc).__name__}: {exc})",
                                   os.path.join(folder, CONFIG)) from None
        cfg.inference_mode = False  # the saved config says True; training had it False (trainable adapters)
        configs[name] = cfg

    def wrap(model):  # run inside build_model's clients.quiet block: what peft prints is held there
        names = list(configs)
        wrapped = peft.get_peft_model(model, configs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            wrapped.add_adapter(name, configs[name])
        return wrapped

    built = hf_model.build_model(base, trust_remote_code=trust_remote_code, wrap=wrap)
    _check_files(built.model, adapters, peft)
    kinds = sorted({str(getattr(c.peft_type, "value", c.peft_type)) for c in configs.values()})
    extras = [word for word, on in (("DoRA", any(getattr(c, "use_dora", False) for c in configs.values())),
                                    ("modules_to_save", any(getattr(c, "modules_to_save", None) for c in configs.values())),
                                    ("trainable tokens", any(getattr(c, "trainable_token_indices", None)
                                                             for c in configs.values()))) if on]
    definition = hf_model.define(built.model, built.architecture, built.written_by, base, built.torch,
                                 built.transformers)
    definition.wrapped = (f"{type(built.model).__name__} ({', '.join(kinds)}{', ' + ', '.join(extras) if extras else ''}; "
                          f"adapter {', '.join(repr(n) for n in configs)}) built by peft {peft.__version__} from "
                          f"{first_config} (base model {found})")
    from statekit import versions

    line = versions.outside("peft", peft.__version__)
    if line:
        definition.warnings.append(f"{line}; the adapter's model was wrapped with it")
    written = next((c.get("peft_version") for c in raw.values() if isinstance(c.get("peft_version"), str)), None)
    if written and written.split("+")[0] != peft.__version__:
        definition.traced = ((definition.traced + "; ") if definition.traced else "") + (
            f"the adapter was written by peft {written}; wrapped here by {peft.__version__} (the adapter file's "
            "names and shapes checked)")
    return definition


def _check_files(model, adapters: dict[str, str], peft) -> None:
    """peft's own state dict of the wrapped model must be the adapter file, name for name and shape
    for shape (adapter by adapter); the first difference is refused naming the tensor."""
    for name, folder in adapters.items():
        weights = next((os.path.join(folder, w) for w in WEIGHTS if os.path.isfile(os.path.join(folder, w))), None)
        if weights is None:
            raise MappingError(f"no adapter weights ({' or '.join(WEIGHTS)}) beside {CONFIG}: the adapter's names "
                               "cannot be checked", folder)
        have = _saved_shapes(weights)
        with clients.quiet("peft listing the adapter's tensors"):
            want = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(model, adapter_name=name).items()}
        for key in sorted(set(have) | set(want)):
            if have.get(key) != want.get(key):
                if key not in want:
                    why = f"holds {key} {list(have[key])}, which the model peft wraps from {CONFIG} does not have"
                elif key not in have:
                    why = f"lacks {key} {list(want[key])}, which the model peft wraps from {CONFIG} has"
                else:
                    why = (f"holds {key} as {list(have[key])} but the model peft wraps from {CONFIG} makes it "
                           f"{list(want[key])}")
                raise MappingError(f"{why}: the base model is not the one this adapter was trained on, or the "
                                   "config differs (give the right one with --model-config)", weights)


def _saved_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The adapter file's tensor names and shapes (safetensors header, or a torch state_dict)."""
    if path.endswith(".safetensors"):
        from statekit.frameworks.safetensors_io import SafetensorsFile

        with SafetensorsFile(path) as sf:
            return {n: tuple(shape) for n, (_, shape) in sf.entries.items()}
    from statekit.formats import torch_pt
    from statekit.frameworks import torch_state

    sd = torch_state.find_model(torch_pt.load_pt(path))
    if sd is None:
        raise MappingError("holds no adapter state_dict", path)
    return {m.path: tuple(m.shape) for m in torch_state.read_model(sd).params}
