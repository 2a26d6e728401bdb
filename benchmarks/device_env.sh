# Sourced first by a device-call script (kept as benchmarks/results/<session>/callN/callN.sh) from
# the root of the snapshot it runs in (a `git archive` of one commit, plus `.whl/` with the test
# wheels the device lacks and `.sha` with that commit): installs the wheels, sets the environment
# every benchmark records (PYTHONPATH, PTXTRAIN_GIT_SHA) and prints the GPU it landed on.
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
mkdir -p "$OUT/logs"
