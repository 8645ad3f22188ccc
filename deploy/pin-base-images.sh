#!/usr/bin/env bash
# Pin the Dockerfile's base images to the digests their tags point at now.
#
#   deploy/pin-base-images.sh [Dockerfile]
#
# Rewrites `ARG BUILD_IMAGE=rust:1-bookworm[@sha256:...]` and
# `ARG RUNTIME_IMAGE=debian:bookworm-slim[@sha256:...]` with the current multi-arch index
# digest. Needs registry access and one of: docker (buildx), skopeo, crane. Review the diff and
# the images' release notes before committing; rebuild and rerun the deploy checks after.
set -euo pipefail

dockerfile=${1:-Dockerfile}

digest_of() {
    local ref=$1
    if command -v docker >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1; then
        docker buildx imagetools inspect "$ref" --format '{{.Manifest.Digest}}'
    elif command -v skopeo >/dev/null 2>&1; then
        skopeo inspect --raw "docker://$ref" | sha256sum | awk '{print "sha256:" $1}'
    elif command -v crane >/dev/null 2>&1; then
        crane digest "$ref"
    else
        echo "pin-base-images: need docker buildx, skopeo or crane to read digests" >&2
        return 1
    fi
}

pin() {
    local arg=$1 tag=$2 digest
    digest=$(digest_of "$tag")
    case $digest in
        sha256:*) ;;
        *) echo "pin-base-images: no digest for $tag (got '$digest')" >&2; exit 1 ;;
    esac
    sed -i -E "s|^ARG ${arg}=.*$|ARG ${arg}=${tag}@${digest}|" "$dockerfile"
    echo "$arg -> $tag@$digest"
}

pin BUILD_IMAGE rust:1-bookworm
pin RUNTIME_IMAGE debian:bookworm-slim
