#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (a GPU host is lent by the hour, not kept):
# the loader's CUDA tests, then bench/load.py on cuda:0 over the README's capped link and
# uncapped. Run from the repository root with torch (CUDA build) and the runtime dependencies
# importable; results land in $OUT (or bench/results/gpu).
set -uo pipefail
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L
python3 -c "import torch, aiohttp, huggingface_hub, safetensors
print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
print('aiohttp', aiohttp.__version__, 'huggingface_hub', huggingface_hub.__version__,
      'safetensors', safetensors.__version__)"
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 150 python3 -m pytest -p pytest_asyncio.plugin \
    -p pytest_timeout tests/test_loader.py tests/test_devicemap.py -q -rs 2>&1 | tee "$out/pytest.log"
timeout 240 python3 bench/load.py --device cuda:0 --size 2GB --repeat 2 --out "$out/capped" 2>&1 \
    | tee "$out/load-capped.log"
timeout 150 python3 bench/load.py --device cuda:0 --size 2GB --repeat 2 --bandwidth 0 \
    --out "$out/uncapped" 2>&1 | tee "$out/load-uncapped.log"
