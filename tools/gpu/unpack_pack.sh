# Sourced first by the device scripts (tools/gpu/*.sh), in the repository's root on the device
# host, with the pack's folder as $1: sets R (the tree) and P (the pack), links the tree at
# /work/main (where the tests look for it), puts CUDA on the paths, and unpacks the pack's
# fixtures into the tree and its binaries into /var/tmp/b.
R=$PWD; P=$(cd "$1" && pwd)
mkdir -p /work && { [ -e /work/main ] || ln -s "$R" /work/main; }
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p crates/model/tests/fixtures && tar xJf "$P/fixtures.tar.xz" -C crates/model/tests/fixtures
mkdir -p /var/tmp/b && tar xJf "$P/bins.tar.xz" -C /var/tmp/b
