# Source on a device machine, in the repository root, in every `run` call, after tools/gpu_env.sh
# (see tools/vllm_bundle.sh): keeps the .vllm/part-* that this call carried in /tmp/vllm-parts (with
# .vllm/MANIFEST, small enough to carry every time), and says how many of the MANIFEST's parts are
# there; once all are, checks the md5 and installs vLLM and its wheels into /tmp/vllm-site (about
# 30 s, once per warm machine). When installed: puts /tmp/vllm-site last on PYTHONPATH (the server's own
# bundle keeps its versions) and turns off
# FlashInfer's sampler (FlashInfer is not carried). Run it as: python3 -m vllm.entrypoints.cli.main serve ...
# (/tmp lasts only while the machine stays warm: a part carried to a cold machine is lost with it,
# and the parts must then come again. Missing parts are only reported, never an error.)
# (Sourced, so no `set -e` here, which would stay on in the caller's shell: the work runs in a
# subshell under `set -euo pipefail`, and a failure there is reported.)
(
    set -euo pipefail
    parts=/tmp/vllm-parts site=/tmp/vllm-site
    mkdir -p "$parts"
    for f in .vllm/MANIFEST .vllm/part-*; do
        if [ -f "$f" ]; then cp "$f" "$parts/"; fi
    done
    [ -f "$site/.installed" ] && exit 0
    [ -f "$parts/MANIFEST" ] || { echo "vllm: no .vllm/MANIFEST carried yet"; exit 0; }
    # the MANIFEST: "md5 <md5> <bytes>" for the whole tar.xz, then "<part> <md5> <bytes>" a part
    have=0 all=0 missing=
    while read -r name sum size; do
        all=$((all + 1))
        if [ -f "$parts/$name" ] && [ "$(stat -c %s "$parts/$name")" = "$size" ] \
            && [ "$(md5sum < "$parts/$name" | cut -d' ' -f1)" = "$sum" ]; then
            have=$((have + 1))
        else
            missing+=" $name"
        fi
    done < <(awk '$1 ~ /^part-/' "$parts/MANIFEST")
    echo "vllm: $have of $all parts in $parts${missing:+ (missing:$missing)}"
    [ "$have" = "$all" ] && [ "$all" -gt 0 ] || exit 0
    read -r _ md5 _ < <(awk '$1 == "md5"' "$parts/MANIFEST")
    tmp=/tmp/vllm-unpack
    rm -rf "$site" "$tmp" && mkdir -p "$tmp"
    awk '$1 ~ /^part-/ {print "'"$parts"'/" $1}' "$parts/MANIFEST" | xargs cat > "$tmp/vllm.tar.xz"
    [ "$(md5sum < "$tmp/vllm.tar.xz" | cut -d' ' -f1)" = "$md5" ] \
        || { echo "vllm: the joined parts fail the MANIFEST's md5: rebuild .vllm and carry all again"; rm -rf "$tmp"; exit 1; }
    if command -v xz > /dev/null; then
        tar -C "$tmp" -xJf "$tmp/vllm.tar.xz"
    else
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$tmp/vllm.tar.xz" "$tmp"
    fi
    mv "$tmp/site" "$site"   # vllm/ and its dist-info, importable as they are
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --target "$site" "$tmp"/wheels/*.whl
    rm -rf "$tmp"
    touch "$site/.installed"
    echo "vllm: installed into $site"
) || echo "vllm: install failed (above); /tmp/vllm-site left out of PYTHONPATH"
if [ -f /tmp/vllm-site/.installed ]; then
    case ":${PYTHONPATH:-}:" in
        *:/tmp/vllm-site:*) ;;
        *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/vllm-site ;;  # last: our bundle's versions win
    esac
    export VLLM_USE_FLASHINFER_SAMPLER=0
fi
