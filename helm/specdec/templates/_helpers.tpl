{{/* Names ------------------------------------------------------------------------------------ */}}
{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's object name: <fullname>-gateway | -draft | -target. Args: root, component. */}}
{{- define "specdec.componentName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .root | trunc 54 | trimSuffix "-") .component }}
{{- end }}

{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels ----------------------------------------------------------------------------------- */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" . }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specdec
{{- end }}

{{/* Args: root, component. */}}
{{- define "specdec.componentSelectorLabels" -}}
{{ include "specdec.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specdec.componentLabels" -}}
{{ include "specdec.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Wiring ------------------------------------------------------------------------------------ */}}
{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdec.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image of a component. Args: root, values (the component's values). */}}
{{- define "specdec.image" -}}
{{- $repo := default .root.Values.image.repository .values.image.repository }}
{{- $tag := default (default .root.Chart.AppVersion .root.Values.image.tag) .values.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{- define "specdec.imagePullPolicy" -}}
{{- default .root.Values.image.pullPolicy .values.image.pullPolicy }}
{{- end }}

{{/* The draft model: speculativeConfig.model when set, else draft.model. */}}
{{- define "specdec.draftModel" -}}
{{- default .Values.draft.model .Values.speculativeConfig.model }}
{{- end }}

{{/* <service>.<namespace>.svc.<domain> of a backend's headless Service. Args: root, component. */}}
{{- define "specdec.backendHost" -}}
{{- printf "%s.%s.svc.%s" (include "specdec.componentName" .) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* dns:///<host>:<port>, the address the gateway dials: it resolves the headless Service's name to
     every ready pod (re-resolved every 30 s) and keeps each sequence on one of them.
     Args: root, component, port. */}}
{{- define "specdec.backendAddress" -}}
{{- printf "dns:///%s:%d" (include "specdec.backendHost" .) (int .port) }}
{{- end }}

{{- define "specdec.apiKeySecretName" -}}
{{- if .Values.gateway.apiKey.existingSecret }}
{{- .Values.gateway.apiKey.existingSecret }}
{{- else }}
{{- printf "%s-api-key" (include "specdec.fullname" .) }}
{{- end }}
{{- end }}

{{- define "specdec.apiKeyEnabled" -}}
{{- if or .Values.gateway.apiKey.existingSecret .Values.gateway.apiKey.value }}true{{ end }}
{{- end }}

{{/* Whole cores of a CPU quantity ("2", 2, "1500m" -> 1), at least 1; "" when unset. */}}
{{- define "specdec.cores" -}}
{{- $cpu := toString . }}
{{- if and . (ne $cpu "") }}
{{- if hasSuffix "m" $cpu }}
{{- max 1 (div (int (trimSuffix "m" $cpu)) 1000) }}
{{- else }}
{{- max 1 (int (floor (float64 $cpu))) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Environment ------------------------------------------------------------------------------- */}}
{{/* Settings by field name as SPECDEC_<SERVICE>_<NAME>; null values are left out.
     Args: prefix, config. */}}
{{- define "specdec.configEnv" -}}
{{- $prefix := .prefix }}
{{- range $name, $value := .config }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ printf "%s_%s" $prefix (upper $name) }}
  value: {{ include "specdec.envValue" $value }}
{{- end }}
{{- end }}
{{- end }}

{{/* A value as an env var string: whole numbers without an exponent ("100000000", not "1e+08"). */}}
{{- define "specdec.envValue" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}
{{- printf "%d" (int64 .) | quote }}
{{- else }}
{{- toString . | quote }}
{{- end }}
{{- end }}

{{/* What every specdec container gets. */}}
{{- define "specdec.commonEnv" -}}
- name: SPECDEC_CACHE
  value: {{ .Values.modelCache.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.modelCache.mountPath | quote }}
- name: HOME
  value: /tmp
- name: SPECDEC_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: SPECDEC_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- end }}

{{/* Volumes ----------------------------------------------------------------------------------- */}}
{{- define "specdec.volumes" -}}
- name: model-cache
{{- with .Values.modelCache.persistentVolumeClaim }}
{{- if .enabled }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model-cache" (include "specdec.fullname" $)) .existingClaim }}
{{- else }}
  emptyDir:
    {{- toYaml $.Values.modelCache.emptyDir | nindent 4 }}
{{- end }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "specdec.volumeMounts" -}}
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* TLS --------------------------------------------------------------------------------------- */}}
{{/* The contradictions tls.* may hold, each failing with its reason. */}}
{{- define "specdec.tlsCheck" -}}
{{- with .Values.tls }}
{{- if .enabled }}
{{- if and .certManager.enabled .secretName }}
{{- fail "tls: set secretName (one Secret for every pod) or certManager.enabled (one Certificate per service), not both" }}
{{- end }}
{{- if not (or .certManager.enabled .secretName) }}
{{- fail "tls.enabled needs tls.secretName (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt) or tls.certManager.enabled" }}
{{- end }}
{{- if and .certManager.enabled (not .certManager.issuerRef.name) }}
{{- fail "tls.certManager needs issuerRef.name: an Issuer or ClusterIssuer that fills ca.crt (a CA, Vault or self-signed issuer)" }}
{{- end }}
{{- else if or .http.enabled .grpc.enabled }}
{{- fail "tls.http.enabled and tls.grpc.enabled need tls.enabled (the certificates)" }}
{{- end }}
{{- if and (gt (int .http.clientCertReqs) 0) (not .http.enabled) }}
{{- fail "tls.http.clientCertReqs needs tls.http.enabled (client certificates are an HTTPS feature)" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret mounted in a component's pods. Args: root, component. */}}
{{- define "specdec.tlsSecretName" -}}
{{- if .root.Values.tls.certManager.enabled }}
{{- printf "%s-tls" (include "specdec.componentName" .) }}
{{- else }}
{{- .root.Values.tls.secretName }}
{{- end }}
{{- end }}

{{/* The path of one file of the mounted Secret (tls.crt, tls.key, ca.crt). Args: root, file. */}}
{{- define "specdec.tlsFile" -}}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.tls.mountPath) .file }}
{{- end }}

{{/* The name the gateway (and the backends' probes) check the backends' certificates for: the gateway
     dials the pods' addresses it resolved, so no host name of the dial names them. */}}
{{- define "specdec.backendServerName" -}}
{{- default (printf "%s-backends.%s.svc" (include "specdec.fullname" .) .Release.Namespace) .Values.tls.serverName }}
{{- end }}

{{/* A component's Service names, short to fully qualified. Args: root, component. */}}
{{- define "specdec.serviceDnsNames" -}}
{{- $svc := include "specdec.componentName" . }}
- {{ $svc }}
- {{ printf "%s.%s" $svc .root.Release.Namespace }}
- {{ printf "%s.%s.svc" $svc .root.Release.Namespace }}
- {{ printf "%s.%s.svc.%s" $svc .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{- define "specdec.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "specdec.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "specdec.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* A backend's gRPC probe: kubelet's native gRPC probe speaks plaintext only, so under TLS the image's
     health probe runs in the container, presenting the pod's certificate (mutual TLS). Args: root, port. */}}
{{- define "specdec.grpcProbe" -}}
{{- $root := .root }}
{{- if $root.Values.tls.enabled }}
exec:
  command:
    - python
    - -m
    - specdec.entrypoints.healthcheck
    - {{ printf "localhost:%d" (int .port) | quote }}
    - --tls-ca-file
    - {{ include "specdec.tlsFile" (dict "root" $root "file" "ca.crt") }}
    {{- if $root.Values.tls.mutual }}
    - --tls-cert-file
    - {{ include "specdec.tlsFile" (dict "root" $root "file" "tls.crt") }}
    - --tls-key-file
    - {{ include "specdec.tlsFile" (dict "root" $root "file" "tls.key") }}
    {{- end }}
    - --tls-server-name
    - {{ include "specdec.backendServerName" $root }}
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end }}

{{/* The gateway's HTTP probe of a path: httpGet (kubelet does not check an HTTPS server's certificate),
     or, when HTTPS requires client certificates, a request from the container with the pod's own.
     Args: root, path. */}}
{{- define "specdec.httpProbe" -}}
{{- $tls := .root.Values.tls }}
{{- if and $tls.http.enabled (eq (int $tls.http.clientCertReqs) 2) }}
exec:
  command:
    - python
    - -c
    - "import ssl, sys, urllib.request; c = ssl.create_default_context(cafile=sys.argv[2]); c.check_hostname = False; c.load_cert_chain(sys.argv[3], sys.argv[4]); urllib.request.urlopen(sys.argv[1], timeout=4, context=c)"
    - {{ printf "https://localhost:%d%s" (int .root.Values.gateway.httpPort) .path }}
    - {{ include "specdec.tlsFile" (dict "root" .root "file" "ca.crt") }}
    - {{ include "specdec.tlsFile" (dict "root" .root "file" "tls.crt") }}
    - {{ include "specdec.tlsFile" (dict "root" .root "file" "tls.key") }}
{{- else }}
httpGet:
  path: {{ .path }}
  port: http
  {{- if $tls.http.enabled }}
  scheme: HTTPS
  {{- end }}
{{- end }}
{{- end }}

{{/* Stopping ----------------------------------------------------------------------------------- */}}
{{/* A pod's terminationGracePeriodSeconds: the component's value, else preStopSleepSeconds +
     drainGraceSeconds + 5 s for the process to exit; a value too short to drain fails. Args: root, values. */}}
{{- define "specdec.terminationGracePeriod" -}}
{{- $need := add (int .root.Values.preStopSleepSeconds) (int .root.Values.drainGraceSeconds) }}
{{- $set := .values.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $set }}
{{- add $need 5 }}
{{- else if lt (int $set) (int $need) }}
{{- fail (printf "terminationGracePeriodSeconds %d is shorter than preStopSleepSeconds + drainGraceSeconds (%d): a stopping pod would be killed mid-drain" (int $set) (int $need)) }}
{{- else }}
{{- int $set }}
{{- end }}
{{- end }}

{{/* preStop: wait before SIGTERM while the pod leaves the Services' endpoints and the gateways' DNS. */}}
{{- define "specdec.lifecycle" -}}
{{- if gt (int .Values.preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.preStopSleepSeconds | int | toString | quote }}]
{{- end }}
{{- end }}
