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
