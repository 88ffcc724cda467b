#!/bin/sh
# Creates deploy/users.acl from deploy/users.acl.example with a new random password per role, and
# writes the passwords to .env (STREAMVQA_REDIS_PASSWORD_<ROLE>), where compose reads them.
#
# With a cameras file (the argument, else deploy/cameras.yaml when there is one), the shared
# `ingest` user may touch only those cameras' keys, and each camera gets a user of its own,
# `ingest-<camera>` (deploy/ingest-camera.acl.template: that camera's keys only; its password is
# STREAMVQA_REDIS_PASSWORD_INGEST_<CAMERA>, upper case, `.` and `-` as `_`), for deployments that
# run one ingest per camera: a compromised ingest can then neither read, forge nor drop another
# camera's frames. Run it again after adding a camera.
#
# deploy/users.acl keeps only SHA-256 hashes of the passwords (`#<hash>`), so it may be readable by
# the Redis container's own user; .env holds the passwords themselves and is made private (0600).
# Run it again to change every password (it replaces both), then `docker compose up -d --force-recreate`.
set -eu
cd "$(dirname "$0")/.."
example=deploy/users.acl.example
template=deploy/ingest-camera.acl.template
target=deploy/users.acl
env_file=.env
cameras_file=${1:-}
[ -n "$cameras_file" ] || { [ -e deploy/cameras.yaml ] && cameras_file=deploy/cameras.yaml; } || true

# The `name:` of each entry under the top-level `cameras:` key (the cameras file's documented form).
camera_names() {
    awk '
        /^[^ #-]/ { in_cameras = ($0 ~ /^cameras:/) ; next }
        in_cameras && /^[ -]+name:/ {
            sub(/^[ -]+name:[ ]*/, ""); sub(/[ ]+#.*$/, ""); gsub(/["\047]/, ""); sub(/[ ]+$/, "")
            print
        }' "$1"
}

cameras=""
if [ -n "$cameras_file" ]; then
    cameras=$(camera_names "$cameras_file")
    for cam in $cameras; do
        if ! printf %s "$cam" | grep -Eq '^[A-Za-z0-9_.-]{1,64}$'; then
            echo "$cameras_file: camera name '$cam' is not [A-Za-z0-9_.-]{1,64}; nothing written" >&2
            exit 1
        fi
    done
    [ -n "$cameras" ] || { echo "$cameras_file: no cameras found; nothing written" >&2; exit 1; }
fi

[ -e "$env_file" ] || cp .env.example "$env_file"
chmod 600 "$env_file"
acl=$(mktemp)
env_tmp=$(mktemp)
trap 'rm -f "$acl" "$env_tmp"' EXIT
if [ -n "$cameras" ]; then
    # The shared ingest user: every key pattern for any camera ({*}) becomes one per named camera.
    awk -v cams="$cameras" '
        $1 == "user" && $2 == "ingest" {
            n = split(cams, cam, "\n"); line = ""
            for (i = 1; i <= NF; i++) {
                tok = $i
                if (index(tok, "{*}")) {
                    close_paren = sub(/\)$/, "", tok); out = ""
                    for (c = 1; c <= n; c++) { t = tok; gsub(/\{\*\}/, "{" cam[c] "}", t); out = out (c > 1 ? " " : "") t }
                    tok = out (close_paren ? ")" : "")
                }
                line = line (i > 1 ? " " : "") tok
            }
            print line; next
        }
        { print }' "$example" >"$acl"
    for cam in $cameras; do
        sed "s/@CAM@/$cam/g" "$template" >>"$acl"
    done
else
    cp "$example" "$acl"
fi
roles=$(awk '$1 == "user" && $2 != "default" {print $2}' "$acl")
grep -v '^STREAMVQA_REDIS_PASSWORD_' "$env_file" >"$env_tmp" || true
for role in $roles; do
    password=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
    hash=$(printf %s "$password" | sha256sum | cut -d' ' -f1)
    sed -i "s/^\(user $role on\) >change-me-$role /\1 #$hash /" "$acl"
    echo "STREAMVQA_REDIS_PASSWORD_$(echo "$role" | tr 'a-z.-' 'A-Z__')=$password" >>"$env_tmp"
done
if grep -q '>change-me-' "$acl"; then
    echo "$example: a user's password is not >change-me-<role>; nothing written" >&2
    exit 1
fi
if [ "$(grep '^STREAMVQA_REDIS_PASSWORD_' "$env_tmp" | cut -d= -f1 | sort | uniq -d)" ]; then
    echo "two users map to one password variable (cameras differing only in '.' or '-'?); nothing written" >&2
    exit 1
fi
cat "$env_tmp" >"$env_file"  # keeps the file's mode (0600)
install -m 644 "$acl" "$target"
echo "wrote $target (password hashes) and the passwords of: $(echo $roles) to $env_file" >&2
