{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tandem.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.externalUrl -}}
{{ .Values.redis.externalUrl }}
{{- else -}}
redis://{{ include "tandem.fullname" . }}-redis:6379/0
{{- end -}}
{{- end -}}

{{- define "tandem.headService" -}}
{{ include "tandem.fullname" . }}-head-svc
{{- end -}}

{{- define "tandem.secretName" -}}
{{- if .Values.apiKey.existingSecret -}}
{{ .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value -}}
{{ include "tandem.fullname" . }}-api-key
{{- end -}}
{{- end -}}

{{/* The Ray resource that pins a pool's workers to its group's pods: tandem_prefill or tandem_decode. */}}
{{- define "tandem.poolResource" -}}
tandem_{{ . }}
{{- end -}}

{{/*
The cluster YAML every Tandem process reads: values' `cluster`, with what this deployment decides.
*/}}
{{- define "tandem.clusterConfig" -}}
{{- $c := deepCopy .Values.cluster -}}
{{- $redis := default (dict) $c.redis -}}
{{- $_ := set $redis "url" (include "tandem.redisUrl" .) -}}
{{- $_ = set $c "redis" $redis -}}
{{- $ray := default (dict) $c.ray -}}
{{- $_ = set $ray "address" "auto" -}}
{{- $_ = set $c "ray" $ray -}}
{{- $router := default (dict) $c.router -}}
{{- $_ = set $router "host" "0.0.0.0" -}}
{{- $_ = set $router "port" .Values.router.port -}}
{{- $_ = set $c "router" $router -}}
{{- range $role := list "prefill" "decode" -}}
{{- $pool := default (dict) (get $c $role) -}}
{{- $res := default (dict) $pool.resources -}}
{{- $custom := default (dict) $res.resources -}}
{{- $_ := set $custom (include "tandem.poolResource" $role) 1 -}}
{{- $_ = set $res "resources" $custom -}}
{{- $_ = set $pool "resources" $res -}}
{{- $_ = set $c $role $pool -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}

{{/* Environment every Tandem process gets: the API keys from the Secret. */}}
{{- define "tandem.keyEnv" -}}
{{- $secret := include "tandem.secretName" . -}}
{{- if $secret }}
- name: TANDEM_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: api-key}
- name: TANDEM_ADMIN_KEY
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: admin-key, optional: true}
{{- end }}
{{- end -}}
