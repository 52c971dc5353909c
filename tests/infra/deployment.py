"""What a deployment of infra/main.bicep creates, evaluated from pycep's parse tree (no Bicep CLI, no
Azure): the Function App's identity, its app settings, every role assignment, and the account and
namespace flags that decide what an identity may do.

A small evaluator of the Bicep expressions the templates use: parameters (defaults, or the values a
test deploys with), variables, ``${...}`` interpolation, conditionals, the logical operators, the
functions the templates call, module parameters and outputs, and the properties Azure gives a resource
once it exists. Those last values cannot come from Azure here; they are deterministic stand-ins of the
right shape (a managed identity's client and principal ids, host names), listed in ``_runtime_property``
so that a property the templates start to read and the evaluator does not know fails loudly.

A test reads the settings and role assignments from here and starts the kit against stand-ins that
enforce them, so a change to the Bicep that takes a right away, or renames a setting, fails a test.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tests.infra.bicep_tools import INFRA, MAIN, accessor, body, condition, loop, parse_text, parsed, walk

SUBSCRIPTION = "00000000-0000-0000-0000-000000000001"
RESOURCE_GROUP = "rg-queueing-test"
TENANT = "72f988bf-86f1-41af-91ab-2d7cd011db47"
LOCATION = "westeurope"
STORAGE_SUFFIX = "core.windows.net"
#: the type of every child resource of a PostgreSQL flexible server begins so
POSTGRES_SERVER_CHILD = "Microsoft.DBforPostgreSQL/flexibleServers/"


class DeploymentRefused(Exception):
    """The template refuses these parameters (its guard expression fails, as ARM would fail it)."""


@dataclass(frozen=True)
class Resource:
    """A resource of the deployment: where it is declared, its type and evaluated name."""

    file: str
    symbol: str
    type: str
    name: str

    @property
    def id(self) -> str:
        return (
            f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/{self.type}/{self.name}"
        )


@dataclass(frozen=True)
class RoleAssignment:
    role_definition_id: str
    principal_id: str
    scope: Resource


@dataclass(frozen=True)
class UserAssignedIdentity:
    resource: Resource

    @property
    def name(self) -> str:
        return self.resource.name

    @property
    def client_id(self) -> str:
        return _stable_uuid(self.resource.id, "clientId")

    @property
    def principal_id(self) -> str:
        return _stable_uuid(self.resource.id, "principalId")


def _stable_uuid(*parts: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "|".join(parts)))


def _unique_string(*parts: str) -> str:
    # 13 characters of [a-z0-9], like ARM's uniqueString (not the same hash; Azure's is unpublished)
    return "u" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


@cache
def _expression(text: str) -> Any:
    """A ``${...}`` interpolation's expression, parsed by pycep as the value of a variable."""
    return parse_text(f"var x = {text}\n", "interpolation")["variables"]["x"]["value"]


@dataclass
class _Scope:
    """One template (main.bicep or a module) with the parameter values it was deployed with."""

    path: Path
    params: dict[str, Any]
    deployment: Deployment
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def doc(self) -> dict[str, Any]:
        return parsed(self.path)

    @property
    def file(self) -> str:
        return self.path.relative_to(INFRA).as_posix()

    # -- names ---------------------------------------------------------------------------------------
    def lookup(self, name: str) -> Any:
        if name in self.values:
            return self.values[name]
        doc = self.doc
        if name in doc.get("parameters", {}):
            spec = doc["parameters"][name]
            if name in self.params:
                value = self.params[name]
            elif spec.get("default") is not None:
                value = self.eval(spec["default"])
            else:
                raise KeyError(f"{self.file}: parameter {name} has no value and no default")
            self._check_decorators(name, spec, value)
        elif name in doc.get("variables", {}):
            value = self.eval(doc["variables"][name]["value"])
        elif name in doc.get("resources", {}):
            value = self.resource(name)
        elif name in doc.get("modules", {}):
            value = self.deployment.module(self, name)
        else:
            raise KeyError(name)
        self.values[name] = value
        return value

    def knows(self, name: str) -> bool:
        doc = self.doc
        return any(
            name in doc.get(section, {}) for section in ("parameters", "variables", "resources", "modules")
        )

    def _check_decorators(self, name: str, spec: dict[str, Any], value: Any) -> None:
        for d in spec.get("decorators", []):
            kind, arg = d["type"], d.get("argument")
            if kind == "allowed" and value not in arg:
                raise DeploymentRefused(f"{self.file}: {name}={value!r} is not one of {arg}")
            if kind == "min_value" and value < arg:
                raise DeploymentRefused(f"{self.file}: {name}={value} is below the minimum {arg}")
            if kind == "max_value" and value > arg:
                raise DeploymentRefused(f"{self.file}: {name}={value} is above the maximum {arg}")
            # (a @secure() value is not repeated)
            if kind == "min_length" and len(value) < arg:
                raise DeploymentRefused(f"{self.file}: {name} is shorter than its minimum length {arg}")
            if kind == "max_length" and len(value) > arg:
                raise DeploymentRefused(f"{self.file}: {name} is longer than its maximum length {arg}")

    def resource(self, symbol: str) -> Resource:
        res = self.doc["resources"][symbol]
        cfg = body(res)
        name = self.eval(cfg["name"])
        parent = cfg.get("parent")
        if parent is not None:
            name = f"{self.resource(parent).name}/{name}"
        return Resource(self.file, symbol, res["type"], name)

    # -- expressions ---------------------------------------------------------------------------------
    def eval(self, value: Any) -> Any:
        if isinstance(value, str):
            if self.knows(value):
                return self.lookup(value)
            return self._interpolate(value)
        if isinstance(value, bool | int | float) or value is None:
            return value
        if isinstance(value, list):
            return [self.eval(v) for v in value]
        if isinstance(value, dict) and "operator" in value:
            return self._operator(value["operator"])
        if isinstance(value, dict) and "function" in value:
            return self._function(value["function"]["type"], value["function"].get("parameters") or {})
        if isinstance(value, dict):
            return {self._interpolate(k.strip("'")): self.eval(v) for k, v in value.items()}
        raise TypeError(f"{self.file}: cannot evaluate {value!r}")

    def _interpolate(self, text: str) -> str:
        def one(m: re.Match[str]) -> str:
            return str(self.eval(_expression(m.group(1))))

        return re.sub(r"\$\{([^}]*)\}", one, text)

    def _operator(self, op: dict[str, Any]) -> Any:
        kind, operands = op["type"], op["operands"]
        if kind == "property_accessor":
            return self._property(self.eval_head(operands["operand_1"]), operands["operand_2"])
        if kind == "conditional":
            chosen = "true_value" if self.eval(operands["condition"]) else "false_value"
            return self.eval(operands[chosen])
        if kind == "not":
            return not self.eval(operands["bool_value"])
        if kind == "and":
            return bool(self.eval(operands["operand_1"])) and bool(self.eval(operands["operand_2"]))
        if kind == "or":
            return bool(self.eval(operands["operand_1"])) or bool(self.eval(operands["operand_2"]))
        if kind == "equals":
            return self.eval(operands["operand_1"]) == self.eval(operands["operand_2"])
        if kind == "not_equals":
            return self.eval(operands["operand_1"]) != self.eval(operands["operand_2"])
        raise NotImplementedError(f"{self.file}: operator {kind}")

    def eval_head(self, head: Any) -> Any:
        return self.eval(head)

    def _property(self, obj: Any, accessor: Any) -> Any:
        if isinstance(accessor, dict):  # a.b.c arrives as a, (b, c)
            inner = accessor["operator"]["operands"]
            return self._property(self._property(obj, inner["operand_1"]), inner["operand_2"])
        if isinstance(obj, Resource):
            return self.deployment.resource_property(obj, accessor)
        if isinstance(obj, _ModuleRef):
            if accessor != "outputs":
                raise KeyError(f"{self.file}: a module has outputs, not {accessor!r}")
            return _Outputs(obj.scope)
        if isinstance(obj, _Outputs):
            return obj.scope.eval(obj.scope.doc["outputs"][accessor]["value"])
        if isinstance(obj, dict):
            if accessor not in obj:
                raise KeyError(f"{self.file}: no property {accessor!r} (has {sorted(obj)})")
            return obj[accessor]
        raise TypeError(f"{self.file}: no property {accessor!r} on {obj!r}")

    def _function(self, kind: str, p: dict[str, Any]) -> Any:
        args = {k: self.eval(v) for k, v in p.items() if v is not None}
        if kind == "int":
            value = args["value_to_convert"]
            try:
                return int(value)
            except ValueError:
                raise DeploymentRefused(str(value)) from None
        if kind == "string":
            return str(args["value_to_convert"])
        if kind == "empty":
            return not args["item_to_test"]
        if kind == "concat":
            parts = [args[k] for k in sorted(args, key=lambda k: int(k.split("_")[1]))]
            if all(isinstance(x, list) for x in parts):
                return [item for part in parts for item in part]
            return "".join(map(str, parts))
        if kind == "take":
            return args["original_value"][: args["number_to_take"]]
        if kind == "replace":
            return args["original_string"].replace(args["old_string"], args["new_string"])
        if kind == "to_lower":
            return args["string_to_change"].lower()
        if kind == "contains":
            return args["item_to_find"] in args["container"]
        if kind == "unique_string":
            return _unique_string(*map(str, args.values()))
        if kind == "guid":
            return _stable_uuid(*map(str, args.values()))
        if kind == "subscription_resource_id":
            return (
                f"/subscriptions/{SUBSCRIPTION}/providers/{args['resource_type']}/{args['resource_name_1']}"
            )
        if kind == "resource_group":
            return {
                "id": f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}",
                "location": LOCATION,
                "name": RESOURCE_GROUP,
            }
        if kind == "tenant":
            return {"tenantId": TENANT}
        if kind == "environment":
            return {"suffixes": {"storage": STORAGE_SUFFIX}}
        raise NotImplementedError(f"{self.file}: function {kind}")


@dataclass
class _ModuleRef:
    scope: _Scope


@dataclass
class _Outputs:
    scope: _Scope


class _ResourceProperties(dict):  # type: ignore[type-arg]
    pass


@dataclass
class Deployment:
    """``Deployment(parameters)``: main.bicep deployed with these parameters (others: their defaults)."""

    parameters: dict[str, Any]
    _modules: dict[str, _ModuleRef] = field(default_factory=dict)
    #: id of a module's scope -> (the scope declaring the module, the module's symbol)
    _declared_in: dict[int, tuple[_Scope, str]] = field(default_factory=dict)
    main: _Scope = field(init=False)

    def __post_init__(self) -> None:
        self.main = _Scope(MAIN, dict(self.parameters), self)
        # the guards and every module deployment name are evaluated first, as ARM evaluates them
        for name, mod in self.main.doc.get("modules", {}).items():
            if self._deployed(self.main, mod):
                self.main.eval(body(mod)["name"])
                self.module(self.main, name)

    @staticmethod
    def _deployed(scope: _Scope, entity: dict[str, Any]) -> bool:
        cond = condition(entity)
        return cond is None or bool(scope.eval(cond))

    def module(self, scope: _Scope, name: str) -> _ModuleRef:
        key = f"{scope.file}:{name}"
        if key not in self._modules:
            mod = scope.doc["modules"][name]
            if not self._deployed(scope, mod):
                raise KeyError(f"module {name} is not deployed with these parameters")
            params = {k: scope.eval(v) for k, v in body(mod).get("params", {}).items()}
            path = (scope.path.parent / mod["detail"]["path"]).resolve()
            self._modules[key] = _ModuleRef(_Scope(path, params, self))
            self._declared_in[id(self._modules[key].scope)] = (scope, name)
        return self._modules[key]

    def scope_of(self, module: str) -> _Scope:
        return self.module(self.main, module).scope

    # -- the order ARM creates resources in ----------------------------------------------------------
    def waits_for(self, module: str | None, symbol: str) -> set[Resource]:
        """Every resource ARM has created before it starts on ``symbol`` (a resource of the module
        ``module`` of main.bicep, or of main.bicep itself for None): what the declaration names in
        ``dependsOn`` or ``parent`` and what it references (Bicep makes each reference to another
        resource or module a dependency, through variables too), transitively. Waiting for a module is
        waiting for everything it deploys, and a module's resources wait for what the module waits for.
        A resource not deployed with these parameters drops out, as ARM drops it; an ``existing`` one
        is no dependency."""
        scope = self.main if module is None else self.scope_of(module)
        found: set[Resource] = set()
        self._prerequisites(scope, symbol, found, set())
        return found

    def created_before(self, res: Resource) -> set[Resource]:
        """:meth:`waits_for` of a resource found with :meth:`all_resources`."""
        if res.file == self.main.file:
            return self.waits_for(None, res.symbol)
        [module] = [k.split(":", 1)[1] for k, m in self._modules.items() if m.scope.file == res.file]
        return self.waits_for(module, res.symbol)

    def _prerequisites(
        self, scope: _Scope, symbol: str, found: set[Resource], seen: set[tuple[int, str]]
    ) -> None:
        doc = scope.doc
        entity = doc.get("resources", {}).get(symbol) or doc["modules"][symbol]
        for dep in self._direct_dependencies(scope, entity) - {symbol}:
            self._everything_of(scope, dep, found, seen)
        if id(scope) in self._declared_in:  # the module's own prerequisites, in the scope declaring it
            parent, name = self._declared_in[id(scope)]
            self._prerequisites(parent, name, found, seen)

    def _everything_of(
        self, scope: _Scope, symbol: str, found: set[Resource], seen: set[tuple[int, str]]
    ) -> None:
        """``symbol`` done: the resource and what it waited for, or everything a module deployed."""
        if (id(scope), symbol) in seen:
            return
        seen.add((id(scope), symbol))
        doc = scope.doc
        if symbol in doc.get("resources", {}):
            if loop(doc["resources"][symbol]) is None:
                found.add(scope.resource(symbol))
            self._prerequisites(scope, symbol, found, seen)
            return
        inner = self.module(scope, symbol).scope
        for name in inner.doc.get("resources", {}):
            if self._counts(inner, name):
                self._everything_of(inner, name, found, seen)
        for name in inner.doc.get("modules", {}):
            if self._counts(inner, name):
                self._everything_of(inner, name, found, seen)
        self._prerequisites(scope, symbol, found, seen)

    def _counts(self, scope: _Scope, symbol: str) -> bool:
        """A resource or module this deployment creates (not ``existing``, its condition true)."""
        doc = scope.doc
        if symbol in doc.get("resources", {}):
            res = doc["resources"][symbol]
            return not res["existing"] and self._deployed(scope, res)
        return symbol in doc.get("modules", {}) and self._deployed(scope, doc["modules"][symbol])

    def _direct_dependencies(self, scope: _Scope, entity: dict[str, Any]) -> set[str]:
        doc = scope.doc
        variables = doc.get("variables", {})
        names: set[str] = set()
        # a name written as a literal is often the symbol's own ('roles', 'postgres'): it names the
        # deployment or resource, and refers to nothing
        own = body(entity)
        pending = [
            entity["config"].get("condition"),
            {k: v for k, v in own.items() if not (k == "name" and isinstance(v, str) and "${" not in v)},
        ]
        expanded: set[str] = set()
        while pending:
            for item in walk(pending.pop()):
                # a bare identifier and a string literal look alike in pycep: a literal that happens to
                # be a symbol's name would count as a reference (none does in these templates)
                heads = set()
                if isinstance(item, str):
                    heads.add(item)
                    heads.update(m.split(".")[0].strip() for m in re.findall(r"\$\{([^}]*)\}", item))
                chain = accessor(item) if isinstance(item, dict) else None
                if chain:
                    heads.add(chain.split(".")[0])
                for head in heads:
                    if head in variables and head not in expanded:
                        expanded.add(head)
                        pending.append(variables[head]["value"])
                    names.add(head)
        return {n for n in names if self._counts(scope, n)}

    def output(self, name: str) -> Any:
        return self.main.eval(self.main.doc["outputs"][name]["value"])

    # -- what Azure would report for a deployed resource ---------------------------------------------
    def resource_property(self, res: Resource, path: str) -> Any:
        if path == "id":
            return res.id
        if path == "name":
            return res.name
        if path == "properties":
            return _ResourceProperties(_runtime_property(res))
        raise KeyError(f"{res.file}: {res.type} {res.symbol}.{path} is not modelled")

    # -- the Function App ----------------------------------------------------------------------------
    @property
    def function_app(self) -> tuple[_Scope, dict[str, Any]]:
        scope = self.scope_of("functionApp")
        [site] = [r for r in scope.doc["resources"].values() if r["type"] == "Microsoft.Web/sites"]
        return scope, site

    @property
    def app_settings(self) -> dict[str, str]:
        scope, site = self.function_app
        settings = scope.eval(body(site)["properties"]["siteConfig"]["appSettings"])
        names = [s["name"] for s in settings]
        assert len(names) == len(set(names)), f"duplicate app settings: {names}"
        return {s["name"]: str(s["value"]) for s in settings}

    @property
    def site_properties(self) -> dict[str, Any]:
        scope, site = self.function_app
        return dict(scope.eval(body(site)["properties"]))

    def identities(self) -> tuple[list[UserAssignedIdentity], bool]:
        """The app's user-assigned identities, and whether it also has a system-assigned one."""
        scope, site = self.function_app
        identity = scope.eval(body(site)["identity"])
        kinds = {k.strip() for k in identity["type"].split(",")}
        assigned = [
            UserAssignedIdentity(self._resource_by_id(rid))
            for rid in identity.get("userAssignedIdentities", {})
        ]
        return assigned, "SystemAssigned" in kinds

    def _resource_by_id(self, resource_id: str) -> Resource:
        for res in self.all_resources():
            if res.id == resource_id:
                return res
        raise KeyError(resource_id)

    def all_resources(self) -> list[Resource]:
        out = []
        for scope in [self.main, *(m.scope for m in self._modules.values())]:
            for symbol, res in scope.doc.get("resources", {}).items():
                if res["existing"] or loop(res) is not None or not self._deployed(scope, res):
                    continue
                out.append(scope.resource(symbol))
        return out

    def role_assignments(self) -> list[RoleAssignment]:
        found = []
        for ref in self._modules.values():
            scope = ref.scope
            for res in scope.doc.get("resources", {}).values():
                if res["type"] != "Microsoft.Authorization/roleAssignments" or not self._deployed(scope, res):
                    continue
                cfg = body(res)
                props = scope.eval(cfg["properties"])
                target = scope.resource(cfg["scope"])
                found.append(
                    RoleAssignment(
                        role_definition_id=props["roleDefinitionId"].rsplit("/", 1)[1],
                        principal_id=props["principalId"],
                        scope=Resource(target.file, target.symbol, target.type, target.name),
                    )
                )
        return found

    def roles_of(self, principal_id: str, scope_type: str) -> set[str]:
        return {
            a.role_definition_id
            for a in self.role_assignments()
            if a.principal_id == principal_id and a.scope.type == scope_type
        }

    def resource_properties(self, module: str, resource_type: str) -> dict[str, Any]:
        scope = self.scope_of(module)
        [res] = [
            r for r in scope.doc["resources"].values() if r["type"] == resource_type and not r["existing"]
        ]
        return dict(scope.eval(body(res).get("properties", {})))


def _runtime_property(res: Resource) -> dict[str, Any]:
    """The properties Azure gives a resource once it exists, as far as the templates read them."""
    name = res.name.rsplit("/", 1)[-1]
    if res.type == "Microsoft.ManagedIdentity/userAssignedIdentities":
        identity = UserAssignedIdentity(res)
        return {"clientId": identity.client_id, "principalId": identity.principal_id, "tenantId": TENANT}
    if res.type == "Microsoft.Storage/storageAccounts":
        return {
            "primaryEndpoints": {
                s: f"https://{name}.{s}.{STORAGE_SUFFIX}/" for s in ("blob", "queue", "table")
            }
        }
    if res.type == "Microsoft.ServiceBus/namespaces":
        return {"serviceBusEndpoint": f"https://{name}.servicebus.windows.net:443/"}
    if res.type == "Microsoft.Insights/components":
        key = _stable_uuid(res.id, "instrumentationKey")
        return {
            "ConnectionString": f"InstrumentationKey={key};IngestionEndpoint=https://{LOCATION}.in.applicationinsights.azure.com/"
        }
    if res.type == "Microsoft.KeyVault/vaults/secrets":
        vault = res.name.split("/")[0]
        return {"secretUri": f"https://{vault}.vault.azure.net/secrets/{name}"}
    if res.type == "Microsoft.DBforPostgreSQL/flexibleServers":
        return {"fullyQualifiedDomainName": f"{name}.postgres.database.azure.com"}
    if res.type == "Microsoft.Web/sites":
        return {"defaultHostName": f"{name}.azurewebsites.net"}
    raise KeyError(f"{res.file}: the properties of {res.type} ({res.symbol}) are not modelled")


def deploy(**parameters: Any) -> Deployment:
    """main.bicep with the parameters a user passes (``apiKey`` is required; the rest default)."""
    parameters.setdefault("apiKey", "test-ops-key")
    return Deployment(parameters)
