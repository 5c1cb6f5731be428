"""Build hook only (all metadata is in pyproject.toml): ship the top-level csrc/ C++ sources in the
wheel as vllm_lite/_csrc/, where vllm_lite.worker.attention.cpu_kernels finds them when there is no
source tree. They are compiled on first use, not here."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc"
SUFFIXES = (".cpp", ".h")


class BuildPyWithCsrc(build_py):
    """build_py that also copies csrc/*.cpp|*.h into the built package."""

    def _csrc_targets(self) -> list[tuple[Path, Path]]:
        dst = Path(self.build_lib) / "vllm_lite" / "_csrc"
        return [(p, dst / p.name) for p in sorted(CSRC.iterdir()) if p.suffix in SUFFIXES]

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the repository's csrc/ directly
            return
        targets = self._csrc_targets()
        if not targets:
            raise RuntimeError(f"no C++ sources in {CSRC}: the wheel would have no native kernels")
        for src, dst in targets:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return outputs + [str(dst) for _, dst in self._csrc_targets()]


setup(cmdclass={"build_py": BuildPyWithCsrc})
