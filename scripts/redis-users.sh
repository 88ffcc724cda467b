#!/bin/sh
# Creates deploy/users.acl from deploy/users.acl.example with a new random password per role, and
# writes the passwords to .env (STREAMVQA_REDIS_PASSWORD_<ROLE>), where compose reads them.
#
# deploy/users.acl keeps only SHA-256 hashes of the passwords (`#<hash>`), so it may be readable by
# the Redis container's own user; .env holds the passwords themselves and is made private (0600).
# Run it again to change every password (it replaces both), then `docker compose up -d --force-recreate`.
set -eu
cd "$(dirname "$0")/.."
example=deploy/users.acl.example
target=deploy/users.acl
env_file=.env
roles=$(awk '$1 == "user" && $2 != "default" {print $2}' "$example")

[ -e "$env_file" ] || cp .env.example "$env_file"
chmod 600 "$env_file"
acl=$(mktemp)
env_tmp=$(mktemp)
trap 'rm -f "$acl" "$env_tmp"' EXIT
cp "$example" "$acl"
grep -v '^STREAMVQA_REDIS_PASSWORD_' "$env_file" >"$env_tmp" || true
for role in $roles; do
    password=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
    hash=$(printf %s "$password" | sha256sum | cut -d' ' -f1)
    sed -i "s/^\(user $role on\) >change-me-$role /\1 #$hash /" "$acl"
    echo "STREAMVQA_REDIS_PASSWORD_$(echo "$role" | tr a-z A-Z)=$password" >>"$env_tmp"
done
if grep -q '>change-me-' "$acl"; then
    echo "$example: a user's password is not >change-me-<role>; nothing written" >&2
    exit 1
fi
cat "$env_tmp" >"$env_file"  # keeps the file's mode (0600)
install -m 644 "$acl" "$target"
echo "wrote $target (password hashes) and the passwords of: $(echo $roles) to $env_file" >&2
