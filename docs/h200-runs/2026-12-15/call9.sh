source .carry/bootstrap.sh
python3 -c "
import torch
from perfkit.kernels.pdl import pdl_available
from perfkit.kernels.fp8 import fp8_supported
from perfkit.runtime.quant import nvfp4_backend
d = torch.device('cuda')
print('pdl_available', pdl_available(d), 'fp8_supported', fp8_supported('cuda'), 'nvfp4_backend', nvfp4_backend('cuda'))
"
timeout 200 python3 -m pytest -q -m gpu tests/test_pdl.py tests/test_kv_fp8.py -k "launchers or chain or 31b-fp8 or 31b-nvfp4 or fp8" > $OUT/9-tests.log 2>&1
tail -2 $OUT/9-tests.log
