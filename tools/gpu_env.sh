# Source on a device machine, in the repository root, in every `run` call that carries [".gpu"]
# (see tools/gpu_bundle.sh): installs the wheels into /tmp/site and the tokenizer into /tmp/tok
# once per warm machine, builds the CUDA ops once (about 45 s), leaves NVLink multicast off
# (the device tool's KINDS.md), and exports PYTHONPATH and TOK.
# (a later call of a warm machine may leave .gpu behind to carry something else: what is installed stays)
if [ -d .gpu/whl ] && [ "$(ls .gpu/whl)" != "$(cat /tmp/site/.bundle 2>/dev/null)" ]; then  # (again after a bundle change)
    pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/whl/*.whl && ls .gpu/whl > /tmp/site/.bundle
fi
[ -d /tmp/tok ] || cp -r .gpu/tok /tmp/tok 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TOK=/tmp/tok
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ls fastdeploy_ops*.so >/dev/null 2>&1 || python3 setup_ops.py build_ext --inplace > /tmp/ops_build.log 2>&1 \
    || { echo "CUDA ops build failed: tail /tmp/ops_build.log"; tail -20 /tmp/ops_build.log; }
