"""The encoder factory: which encoder a multimodal engine dir holds (visual or audio), loaded; it sits above both
encoder modules so neither imports the other."""

from __future__ import annotations

from pathlib import Path

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import read_json
from kvforge.contract.multimodal import AUDIO, ENCODER_FORMAT, VISUAL, AudioEncoderConfig, EncoderConfig
from kvforge.runtime.inputs.multimodal.audio import AudioEncoder
from kvforge.runtime.inputs.multimodal.encoder_session import FIELD
from kvforge.runtime.inputs.multimodal.visual import VisualEncoder


def load_encoder(engine_dir: Path, num_threads: int = 0) -> VisualEncoder | AudioEncoder:
    if not engine_dir.is_dir():
        raise InvalidConfig(f"{engine_dir} is not a directory", FIELD)
    data = read_json(engine_dir / "config.json", FIELD)
    where = f"{engine_dir}/config.json"
    if data.get("format") != ENCODER_FORMAT:
        raise InvalidConfig(f"{engine_dir} is not a kvforge encoder dir (a text engine?); give the dir llm_build "
                            "wrote from llm_export's OUTPUTDIR/visual or OUTPUTDIR/audio", FIELD)
    if data.get("kind") == AUDIO:
        return AudioEncoder(engine_dir, AudioEncoderConfig.from_dict(data, where), num_threads)
    if data.get("kind") != VISUAL and "kind" in data:
        raise InvalidConfig(f"unsupported encoder kind {data.get('kind')!r}", FIELD)
    return VisualEncoder(engine_dir, EncoderConfig.from_dict(data, where), num_threads)
