{{/* The Deployment of a draft or target service: one skeleton, as the services share one.
     Args: root, role ("draft" | "target"). */}}
{{- define "specdec.backendDeployment" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $prefix := printf "SPECDEC_%s" (upper $role) }}
{{- $spec := $root.Values.speculativeConfig }}
{{- $ctx := dict "root" $root "component" $role }}
{{- $tls := $root.Values.tls }}
{{- include "specdec.tlsCheck" $root }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.componentLabels" $ctx | nindent 4 }}
spec:
  {{- if not (and (hasKey $v "autoscaling") $v.autoscaling.enabled) }}
  replicas: {{ $v.replicaCount }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "specdec.componentSelectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "specdec.componentSelectorLabels" $ctx | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "specdec.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ include "specdec.terminationGracePeriod" (dict "root" $root "values" $v) }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "specdec.image" (dict "root" $root "values" $v) | quote }}
          imagePullPolicy: {{ include "specdec.imagePullPolicy" (dict "root" $root "values" $v) }}
          args:
            - {{ $role }}-service
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "specdec.commonEnv" $root | nindent 12 }}
            - name: {{ $prefix }}_MODEL
              value: {{ ternary (include "specdec.draftModel" $root) $v.model (eq $role "draft") | quote }}
            - name: {{ $prefix }}_PORT
              value: {{ include "specdec.envValue" $v.port }}
            - name: {{ $prefix }}_METRICS_PORT
              value: {{ include "specdec.envValue" $v.metricsPort }}
            # On SIGTERM: not ready at once, in-flight work finishes within this, then exit.
            - name: {{ $prefix }}_DRAIN_GRACE_SECONDS
              value: {{ include "specdec.envValue" $root.Values.drainGraceSeconds }}
            {{- if $tls.enabled }}
            # The gRPC port speaks TLS only{{ if $tls.mutual }}; clients (the gateways) must present a certificate signed by ca.crt{{ end }}.
            - name: {{ $prefix }}_TLS_CERT_FILE
              value: {{ include "specdec.tlsFile" (dict "root" $root "file" "tls.crt") | quote }}
            - name: {{ $prefix }}_TLS_KEY_FILE
              value: {{ include "specdec.tlsFile" (dict "root" $root "file" "tls.key") | quote }}
            {{- if $tls.mutual }}
            - name: {{ $prefix }}_TLS_CLIENT_CA_FILE
              value: {{ include "specdec.tlsFile" (dict "root" $root "file" "ca.crt") | quote }}
            {{- end }}
            {{- end }}
            {{- with $spec.max_model_len }}
            - name: {{ $prefix }}_MAX_MODEL_LEN
              value: {{ include "specdec.envValue" . }}
            {{- end }}
            {{- if not (hasKey $v.config "num_threads") }}
            {{- $cores := include "specdec.cores" (coalesce (dig "limits" "cpu" "" $v.resources) (dig "requests" "cpu" "" $v.resources)) }}
            {{- if $cores }}
            - name: {{ $prefix }}_NUM_THREADS
              value: {{ $cores | quote }}
            {{- end }}
            {{- end }}
            {{- if eq $role "draft" }}
            - name: SPECDEC_DRAFT_DRAFT_SAMPLE_METHOD
              value: {{ $spec.draft_sample_method | quote }}
            - name: SPECDEC_DRAFT_TLI_PROPOSALS
              value: {{ $spec.tli_proposals | quote }}
            {{- if $spec.use_heterogeneous_vocab }}
            - name: SPECDEC_DRAFT_TARGET_TOKENIZER
              value: {{ $root.Values.target.model | quote }}
            {{- end }}
            {{- if eq ($spec.method | default "draft_model") "eagle3" }}
            {{- /* an EAGLE-3 head reads the target's token embedding and shape */}}
            - name: SPECDEC_DRAFT_TARGET_MODEL
              value: {{ $root.Values.target.model | quote }}
            {{- end }}
            {{- with $spec.revision }}
            - name: SPECDEC_DRAFT_REVISION
              value: {{ . | quote }}
            {{- end }}
            {{- with $spec.quantization }}
            - name: SPECDEC_DRAFT_QUANTIZATION
              value: {{ . | quote }}
            {{- end }}
            - name: SPECDEC_DRAFT_METHOD
              value: {{ $spec.method | default "draft_model" | quote }}
            {{- with $spec.prompt_lookup_max }}
            - name: SPECDEC_DRAFT_PROMPT_LOOKUP_MAX
              value: {{ include "specdec.envValue" . }}
            {{- end }}
            {{- with $spec.prompt_lookup_min }}
            - name: SPECDEC_DRAFT_PROMPT_LOOKUP_MIN
              value: {{ include "specdec.envValue" . }}
            {{- end }}
            {{- range $key := list "suffix_decoding_max_tree_depth" "suffix_decoding_max_cached_requests" "suffix_decoding_max_spec_factor" "suffix_decoding_min_token_prob" "suffix_decoding_min_score" "suffix_decoding_merge_score" "speculative_token_tree" "speculative_eagle_topk" "speculative_num_draft_tokens" }}
            {{- if and (hasKey $spec $key) (not (kindIs "invalid" (get $spec $key))) }}
            - name: SPECDEC_DRAFT_{{ upper $key }}
              value: {{ include "specdec.envValue" (get $spec $key) }}
            {{- end }}
            {{- end }}
            {{- $method := $spec.method | default "draft_model" }}
            {{- /* enable_suffix_decoding applies to an EAGLE-3 head only (the default pair's): another method set
                   without unsetting it still starts */}}
            {{- $suffixFirst := and (eq $method "eagle3") $spec.enable_suffix_decoding }}
            {{- if and (eq $method "eagle3") (hasKey $spec "enable_suffix_decoding") (not (kindIs "invalid" $spec.enable_suffix_decoding)) }}
            - name: SPECDEC_DRAFT_ENABLE_SUFFIX_DECODING
              value: {{ include "specdec.envValue" $spec.enable_suffix_decoding }}
            {{- end }}
            {{- /* the model's own k applies to hybrid drafting only (a lookup method and a model): elsewhere the
                   draft service refuses it, so a method or model set without unsetting it still starts */}}
            {{- $hybrid := and (ne $method "ngram") (ne (include "specdec.draftModel" $root) "none") (or (eq $method "suffix") $spec.prompt_lookup_max $suffixFirst) }}
            {{- if and $hybrid (not (kindIs "invalid" $spec.draft_model_num_speculative_tokens)) }}
            - name: SPECDEC_DRAFT_DRAFT_MODEL_NUM_SPECULATIVE_TOKENS
              value: {{ include "specdec.envValue" $spec.draft_model_num_speculative_tokens }}
            {{- end }}
            {{- end }}
            {{- with include "specdec.configEnv" (dict "prefix" $prefix "config" $v.config) }}
            {{- . | trim | nindent 12 }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
          # grpc.health.v1 answers NOT_SERVING until the model is loaded and warmed up.
          {{- $probe := include "specdec.grpcProbe" (dict "root" $root "port" $v.port) | trim }}
          startupProbe:
            {{- $probe | trim | nindent 12 }}
            {{- toYaml $v.startupProbe | nindent 12 }}
          readinessProbe:
            {{- $probe | trim | nindent 12 }}
            {{- toYaml $v.readinessProbe | nindent 12 }}
          livenessProbe:
            {{- $probe | trim | nindent 12 }}
            {{- toYaml $v.livenessProbe | nindent 12 }}
          {{- with include "specdec.lifecycle" $root }}
          {{- . | trim | nindent 10 }}
          {{- end }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "specdec.volumeMounts" $root | nindent 12 }}
            {{- with include "specdec.tlsVolumeMount" $root }}
            {{- . | trim | nindent 12 }}
            {{- end }}
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "specdec.volumes" $root | nindent 8 }}
        {{- with include "specdec.tlsVolume" $ctx }}
        {{- . | trim | nindent 8 }}
        {{- end }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
