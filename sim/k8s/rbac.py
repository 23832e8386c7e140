"""Authentication and RBAC authorization of the simulated API server, as kube-apiserver does them.

Identities:

* the kubeconfig's bearer token is the cluster admin (``system:masters``): the tests, the
  operator's kubectl and the sim's own controllers are never restricted;
* every ServiceAccount has a token, issued by the TokenRequest API
  (``POST /api/v1/namespaces/{ns}/serviceaccounts/{name}/token``, what ``kubectl create token``
  calls). A token names its ServiceAccount and is signed with the cluster's secret (an HMAC of the
  admin token), so it stays valid across a restart of the same cluster and is refused (401) once
  the ServiceAccount is deleted. Its user is ``system:serviceaccount:{ns}:{name}`` in the groups
  ``system:serviceaccounts``, ``system:serviceaccounts:{ns}`` and ``system:authenticated``;
* the admin may impersonate (``Impersonate-User`` / ``Impersonate-Group``, kubectl's ``--as``);
  a ServiceAccount user impersonated without groups gets its ServiceAccount groups, as upstream.

Authorization is the RBAC authorizer's: the rules of every ClusterRoleBinding and of the
RoleBindings in the request's namespace whose subjects name the user (ServiceAccount, User or
Group), plus the bootstrap roles every authenticated user has (``system:basic-user``,
``system:discovery``, ``system:public-info-viewer``). A request outside them is a 403 ``Status``
with kube-apiserver's message, e.g.::

    pods is forbidden: User "system:serviceaccount:fleetmend:fleetmend-worker" cannot list
    resource "pods" in API group "" in the namespace "inference"

``SelfSubjectAccessReview`` and ``SelfSubjectRulesReview`` (authorization.k8s.io/v1) answer from
the same rules, so ``kubectl auth can-i`` (also ``--list`` and ``--as``) works.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from sim.k8s.audit import ADMIN, User
from sim.k8s.errors import ApiError, bad_request
from sim.k8s.requestinfo import RequestInfo
from sim.k8s.store import ObjectStore

Obj = dict[str, Any]
SA_PREFIX = "system:serviceaccount:"
AUTHENTICATED = "system:authenticated"
RBAC_GROUP = "rbac.authorization.k8s.io"
_TOKEN_PREFIX = "fm-sa"
TOKEN_SECONDS = 3600

# The bootstrap ClusterRoles bound to every authenticated user (k8s.io/kubernetes
# plugin/pkg/auth/authorizer/rbac/bootstrappolicy): reviews of oneself, discovery, health.
BOOTSTRAP_RULES: tuple[Obj, ...] = (
    {"verbs": ["create"], "apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"]},
    {
        "verbs": ["create"],
        "apiGroups": ["authorization.k8s.io"],
        "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
    },
    {
        "verbs": ["get"],
        "nonResourceURLs": [
            "/api",
            "/api/*",
            "/apis",
            "/apis/*",
            "/healthz",
            "/livez",
            "/openapi",
            "/openapi/*",
            "/readyz",
            "/version",
            "/version/",
        ],
    },
)


@dataclass(frozen=True)
class Attributes:
    """What the authorizer decides on (``authorizer.Attributes``)."""

    verb: str
    namespace: str = ""
    group: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""
    path: str = ""  # a non-resource request's path (resource is then "")

    @classmethod
    def of(cls, info: RequestInfo) -> Attributes:
        if not info.is_resource:
            return cls(verb=info.verb, path=info.path)
        return cls(
            verb=info.verb,
            namespace=info.namespace,
            group=info.api_group,
            resource=info.resource,
            subresource=info.subresource,
            name=info.name,
        )

    @property
    def qualified(self) -> str:
        """``resource[/subresource]`` as RBAC rules name it."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def service_account_user(namespace: str, name: str) -> User:
    return User(
        f"{SA_PREFIX}{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
    )


def forbidden(user: User, attrs: Attributes) -> ApiError:
    """kube-apiserver's 403 (``responsewriters.forbiddenMessage`` + ``errors.NewForbidden``)."""
    if not attrs.resource:
        message = f'forbidden: User "{user.username}" cannot {attrs.verb} path "{attrs.path}"'
        return ApiError(403, "Forbidden", message, {})
    where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    reason = (
        f'User "{user.username}" cannot {attrs.verb} resource "{attrs.qualified}" '
        f'in API group "{attrs.group}" {where}'
    )
    group_resource = f"{attrs.resource}.{attrs.group}" if attrs.group else attrs.resource
    subject = f'{group_resource} "{attrs.name}"' if attrs.name else group_resource
    details: Obj = {"name": attrs.name} if attrs.name else {}
    if attrs.group:
        details["group"] = attrs.group
    details["kind"] = attrs.resource
    return ApiError(403, "Forbidden", f"{subject} is forbidden: {reason}", details)


def rule_allows(rule: Obj, attrs: Attributes) -> bool:
    """Whether one PolicyRule covers the request (``rbac.RuleAllows``)."""
    verbs = rule.get("verbs") or []
    if "*" not in verbs and attrs.verb not in verbs:
        return False
    if not attrs.resource:
        urls = rule.get("nonResourceURLs") or []
        return any(
            url == "*" or url == attrs.path or (url.endswith("*") and attrs.path.startswith(url[:-1]))
            for url in urls
        )
    groups = rule.get("apiGroups") or []
    if "*" not in groups and attrs.group not in groups:
        return False
    resources = rule.get("resources") or []
    wanted = attrs.qualified
    if not any(
        r == "*"
        or r == wanted
        or (attrs.subresource and r == f"*/{attrs.subresource}")
        or (attrs.subresource and r == f"{attrs.resource}/*")
        for r in resources
    ):
        return False
    names = rule.get("resourceNames") or []
    return not names or (bool(attrs.name) and attrs.name in names)


def _subject_matches(subject: Obj, user: User) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        return user.username == f"{SA_PREFIX}{subject.get('namespace', '')}:{subject.get('name', '')}"
    if kind == "User":
        return user.username == subject.get("name")
    if kind == "Group":
        return subject.get("name") in user.groups
    return False


@dataclass(frozen=True)
class Grant:
    """The rules one binding gives a user: where they apply ("" = every namespace) and why."""

    binding: str  # 'ClusterRoleBinding "x"' or 'RoleBinding "x/ns"'
    role: str  # 'ClusterRole "y"' or 'Role "y"'
    namespace: str
    rules: tuple[Obj, ...]


class Rbac:
    """The authenticator and RBAC authorizer over the cluster's stored objects."""

    def __init__(self, store: ObjectStore, admin_token: str) -> None:
        self.store = store
        self.admin_token = admin_token
        self._key = hashlib.sha256(b"fleetmend-sim-serviceaccount-tokens:" + admin_token.encode()).digest()

    # ------------------------------------------------------------ tokens
    def issue_token(self, namespace: str, name: str) -> str:
        subject = base64.urlsafe_b64encode(f"{namespace}/{name}".encode()).decode().rstrip("=")
        return f"{_TOKEN_PREFIX}.{subject}.{self._sign(subject)}"

    def _sign(self, subject: str) -> str:
        return hmac.new(self._key, subject.encode(), hashlib.sha256).hexdigest()[:40]

    def _token_subject(self, token: str) -> tuple[str, str] | None:
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _TOKEN_PREFIX:
            return None
        if not hmac.compare_digest(parts[2], self._sign(parts[1])):
            return None
        try:
            decoded = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        namespace, _, name = decoded.partition("/")
        if self.store.find("serviceaccounts", namespace, name) is None:
            return None  # a deleted ServiceAccount's tokens stop working
        return namespace, name

    # ------------------------------------------------------------ authentication
    def authenticated(self, headers: dict[str, str]) -> User | None:
        """The token's own user (before impersonation), or None (401)."""
        header = headers.get("authorization", "")
        if not header.startswith("Bearer "):
            return None
        token = header[len("Bearer ") :]
        if hmac.compare_digest(token, self.admin_token):
            return ADMIN
        subject = self._token_subject(token)
        return service_account_user(*subject) if subject else None

    def authenticate(self, headers: dict[str, str]) -> User | None:
        """The user a request acts as: its token's, or whom the admin impersonates."""
        user = self.authenticated(headers)
        target = headers.get("impersonate-user")
        if user is None or not target or not self.is_admin(user):
            return user
        groups = tuple(g.strip() for g in headers.get("impersonate-group", "").split(",") if g.strip())
        if target.startswith(SA_PREFIX) and not groups:
            namespace, _, name = target[len(SA_PREFIX) :].partition(":")
            return service_account_user(namespace, name)
        return User(target, (*groups, AUTHENTICATED))

    def check_impersonation(self, headers: dict[str, str]) -> None:
        """Only the admin may impersonate (kube-apiserver asks RBAC for ``impersonate users``)."""
        user = self.authenticated(headers)
        target = headers.get("impersonate-user")
        if user is not None and target and not self.is_admin(user):
            raise forbidden(user, Attributes(verb="impersonate", resource="users", name=target))

    @staticmethod
    def is_admin(user: User) -> bool:
        return "system:masters" in user.groups

    # ------------------------------------------------------------ authorization
    def grants(self, user: User, namespace: str | None) -> list[Grant]:
        """The bindings that give ``user`` rules: cluster-wide ones, and those in ``namespace``
        (None: in every namespace)."""
        found: list[Grant] = []
        for binding in self.store.list_view("clusterrolebindings"):
            if any(_subject_matches(s, user) for s in binding.get("subjects") or []):
                rules = self._role_rules(binding.get("roleRef") or {}, "")
                if rules is not None:
                    found.append(
                        Grant(
                            f'ClusterRoleBinding "{binding["metadata"]["name"]}"',
                            f'ClusterRole "{(binding.get("roleRef") or {}).get("name", "")}"',
                            "",
                            rules,
                        )
                    )
        for binding in self.store.list_view("rolebindings", namespace):
            if any(_subject_matches(s, user) for s in binding.get("subjects") or []):
                ns = binding["metadata"].get("namespace", "")
                ref = binding.get("roleRef") or {}
                rules = self._role_rules(ref, ns)
                if rules is not None:
                    found.append(
                        Grant(
                            f'RoleBinding "{binding["metadata"]["name"]}/{ns}"',
                            f'{ref.get("kind", "")} "{ref.get("name", "")}"',
                            ns,
                            rules,
                        )
                    )
        return found

    def _role_rules(self, ref: Obj, namespace: str) -> tuple[Obj, ...] | None:
        kind, name = ref.get("kind"), str(ref.get("name", ""))
        if kind == "ClusterRole":
            role = self.store.find("clusterroles", "", name)
        elif kind == "Role" and namespace:
            role = self.store.find("roles", namespace, name)
        else:
            return None
        return tuple(role.get("rules") or []) if role is not None else None

    def decide(self, user: User, attrs: Attributes) -> tuple[bool, str]:
        """(allowed, reason): the reason names the binding that allowed, as the RBAC authorizer says."""
        if self.is_admin(user):
            return True, ""
        if AUTHENTICATED in user.groups and any(rule_allows(r, attrs) for r in BOOTSTRAP_RULES):
            return True, "RBAC: allowed by the bootstrap roles of system:authenticated"
        for grant in self.grants(user, attrs.namespace or ""):
            if grant.namespace and grant.namespace != attrs.namespace:
                continue
            if any(rule_allows(rule, attrs) for rule in grant.rules):
                subject = user.username
                if subject.startswith(SA_PREFIX):
                    ns, _, name = subject[len(SA_PREFIX) :].partition(":")
                    subject = f'ServiceAccount "{name}/{ns}"'
                else:
                    subject = f'User "{subject}"'
                return True, f"RBAC: allowed by {grant.binding} of {grant.role} to {subject}"
        return False, ""

    def authorize(self, user: User, info: RequestInfo) -> None:
        """Raise the 403 a request outside the user's rules gets."""
        attrs = Attributes.of(info)
        if not self.decide(user, attrs)[0]:
            raise forbidden(user, attrs)

    def rules(self, user: User, namespace: str) -> tuple[list[Obj], list[Obj]]:
        """(resourceRules, nonResourceRules) that apply to ``user`` in ``namespace``."""
        if self.is_admin(user):
            return (
                [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}],
                [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            )
        collected: list[Obj] = list(BOOTSTRAP_RULES) if AUTHENTICATED in user.groups else []
        for grant in self.grants(user, namespace):
            if not grant.namespace or grant.namespace == namespace:
                collected.extend(grant.rules)
        resource_rules: list[Obj] = []
        non_resource_rules: list[Obj] = []
        for rule in collected:
            if rule.get("nonResourceURLs"):
                non_resource_rules.append(
                    {"verbs": rule["verbs"], "nonResourceURLs": rule["nonResourceURLs"]}
                )
            else:
                entry: Obj = {
                    "verbs": list(rule.get("verbs") or []),
                    "apiGroups": list(rule.get("apiGroups") or []),
                    "resources": list(rule.get("resources") or []),
                }
                if rule.get("resourceNames"):
                    entry["resourceNames"] = list(rule["resourceNames"])
                resource_rules.append(entry)
        return resource_rules, non_resource_rules

    # ------------------------------------------------------------ the review and token APIs
    def serve(self, user: User, info: RequestInfo, body: Any, now: str, expires: str) -> Obj | None:
        """The answer to a SelfSubjectAccessReview, SelfSubjectRulesReview or TokenRequest
        ``create``; None for any other request."""
        if info.verb != "create":
            return None
        if info.api_group == "authorization.k8s.io" and info.api_version == "v1" and not info.name:
            if info.resource == "selfsubjectaccessreviews":
                return self._access_review(user, _review_body(body, "SelfSubjectAccessReview"))
            if info.resource == "selfsubjectrulesreviews":
                return self._rules_review(user, _review_body(body, "SelfSubjectRulesReview"))
        if (
            info.api_group == ""
            and info.resource == "serviceaccounts"
            and info.subresource == "token"
            and info.name
        ):
            self.store.get("serviceaccounts", info.namespace, info.name)  # 404 if absent
            spec = (body or {}).get("spec") or {} if isinstance(body, dict) else {}
            return {
                "kind": "TokenRequest",
                "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"name": info.name, "namespace": info.namespace, "creationTimestamp": now},
                "spec": {
                    "audiences": spec.get("audiences") or ["https://kubernetes.default.svc.cluster.local"],
                    "expirationSeconds": spec.get("expirationSeconds") or TOKEN_SECONDS,
                    "boundObjectRef": spec.get("boundObjectRef"),
                },
                "status": {
                    "token": self.issue_token(info.namespace, info.name),
                    "expirationTimestamp": expires,
                },
            }
        return None

    def _access_review(self, user: User, review: Obj) -> Obj:
        spec = review.get("spec") or {}
        resource_attrs = spec.get("resourceAttributes")
        non_resource = spec.get("nonResourceAttributes")
        if resource_attrs:
            attrs = Attributes(
                verb=str(resource_attrs.get("verb", "")),
                namespace=str(resource_attrs.get("namespace", "")),
                group=str(resource_attrs.get("group", "")),
                resource=str(resource_attrs.get("resource", "")),
                subresource=str(resource_attrs.get("subresource", "")),
                name=str(resource_attrs.get("name", "")),
            )
        elif non_resource:
            attrs = Attributes(verb=str(non_resource.get("verb", "")), path=str(non_resource.get("path", "")))
        else:
            raise _invalid_review(
                "SelfSubjectAccessReview",
                "spec.resourceAttributes",
                "exactly one of nonResourceAttributes or resourceAttributes must be specified",
            )
        allowed, reason = self.decide(user, attrs)
        status: Obj = {"allowed": allowed}
        if reason:
            status["reason"] = reason
        return {
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }

    def _rules_review(self, user: User, review: Obj) -> Obj:
        spec = review.get("spec") or {}
        namespace = str(spec.get("namespace") or "")
        resource_rules, non_resource_rules = self.rules(user, namespace)
        return {
            "kind": "SelfSubjectRulesReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": {
                "resourceRules": resource_rules,
                "nonResourceRules": non_resource_rules,
                "incomplete": False,
            },
        }


def _review_body(body: Any, kind: str) -> Obj:
    if not isinstance(body, dict):
        raise bad_request(f"the body of the request must be an authorization.k8s.io/v1 {kind}")
    if body.get("kind") not in (None, kind):
        raise bad_request(
            f"the object provided is unrecognized (must be of type {kind}): kind {body.get('kind')!r}"
        )
    return body


def _invalid_review(kind: str, field: str, message: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{kind}.authorization.k8s.io "" is invalid: {field}: Invalid value: "null": {message}',
        {
            "group": "authorization.k8s.io",
            "kind": kind,
            "causes": [
                {
                    "reason": "FieldValueInvalid",
                    "message": f'Invalid value: "null": {message}',
                    "field": field,
                }
            ],
        },
    )


# ---------------------------------------------------------------------------- protobuf bodies
# kubectl's typed clients send access reviews as application/vnd.kubernetes.protobuf: the "k8s\0"
# magic, then a runtime.Unknown (1: typeMeta{1: apiVersion, 2: kind}, 2: raw) whose raw bytes are
# the review (1: metadata, 2: spec). Only the spec's string fields are read, as below (field
# numbers from k8s.io/api/authorization/v1/generated.proto).
_PROTO_MAGIC = b"k8s\x00"
_RESOURCE_ATTRIBUTES = ("namespace", "verb", "group", "version", "resource", "subresource", "name")
_NON_RESOURCE_ATTRIBUTES = ("path", "verb")


def _fields(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields of one protobuf message (last one wins; varints skipped)."""
    found: dict[int, bytes] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        value, shift = 0, 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            varint()
        elif wire == 2:
            length = varint()
            found[number] = data[i : i + length]
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return found


def _strings(data: bytes, names: tuple[str, ...]) -> Obj:
    fields = _fields(data)
    return {name: fields[n + 1].decode() for n, name in enumerate(names) if n + 1 in fields}


def review_from_protobuf(raw: bytes) -> Obj:
    """A SelfSubjectAccessReview or SelfSubjectRulesReview sent as Kubernetes protobuf, as JSON."""
    if not raw.startswith(_PROTO_MAGIC):
        raise bad_request("the protobuf body does not start with the Kubernetes magic number")
    try:
        unknown = _fields(raw[len(_PROTO_MAGIC) :])
        type_meta = _strings(unknown.get(1, b""), ("apiVersion", "kind"))
        spec_raw = _fields(unknown.get(2, b"")).get(2, b"")
        kind = type_meta.get("kind", "")
        spec: Obj
        if kind == "SelfSubjectAccessReview":
            parts = _fields(spec_raw)
            spec = {}
            if 1 in parts:
                spec["resourceAttributes"] = _strings(parts[1], _RESOURCE_ATTRIBUTES)
            if 2 in parts:
                spec["nonResourceAttributes"] = _strings(parts[2], _NON_RESOURCE_ATTRIBUTES)
        elif kind == "SelfSubjectRulesReview":
            spec = _strings(spec_raw, ("namespace",))
        else:
            raise bad_request(f"the simulated API server decodes no protobuf {kind or 'object'}")
    except (IndexError, UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the protobuf body could not be decoded: {exc}") from None
    return {"kind": kind, "apiVersion": type_meta.get("apiVersion", ""), "spec": spec}
