<?php

/**
 * phorge-bridge: the Conduit methods that let phorge-bridge run Phorge's task
 * queue from Celery while Phorge's own PHP workers keep doing the work.
 *
 *   - worker.execute runs one leased task's worker in this PHP process and
 *     reports the outcome; it never reads or writes the queue tables (the
 *     bridge owns the lease and records the outcome itself).
 *   - worker.feedstory returns what FeedPublisherHTTPWorker would POST for a
 *     feed story, so the bridge can deliver feed.http-hooks itself.
 *   - worker.version reports the installed release and this file's sha256,
 *     so "phorge-bridge doctor" can tell a missing or outdated copy.
 *
 * All three methods are callable only by an authenticated administrator account
 * (typically a bot made administrator for the bridge, with an API token).
 *
 * Installed by "phorge-bridge phorge install-extension"; the installed copy
 * is overwritten on upgrade, so do not edit it. Every class lives in this one
 * file because Phorge loads extension files in no particular order.
 *
 * Written for PHP 7.2 (Phorge's minimum): no arrow functions, typed
 * properties or other newer syntax.
 */
abstract class PhorgeBridgeConduitAPIMethod extends ConduitAPIMethod {

  const ERR_PERMISSION = 'ERR-BRIDGE-PERMISSION';
  const ERR_PARAMETER = 'ERR-BRIDGE-PARAMETER';
  const ERR_READ_ONLY = 'ERR-BRIDGE-READ-ONLY';

  // The phorge-bridge release this file ships with (read by the bridge's
  // Python too); worker.version reports it with this file's sha256.
  const VERSION = '0.2.0.dev0';

  // These four make sure no configuration (policy.allow-public, OAuth
  // clients) can open the methods to anyone but an authenticated caller.
  final public function shouldRequireAuthentication() {
    return true;
  }

  final public function shouldAllowPublic() {
    return false;
  }

  final public function getRequiredScope() {
    return self::SCOPE_NEVER;
  }

  final public function getPolicy($capability) {
    // Hides the methods from non-administrators in the API console too.
    return PhabricatorPolicies::POLICY_ADMIN;
  }

  public function getMethodStatus() {
    return self::METHOD_STATUS_UNSTABLE;
  }

  public function getMethodStatusDescription() {
    return pht(
      'Internal method of phorge-bridge (the Celery task runner); its '.
      'parameters and results follow the bridge, not a public contract.');
  }

  protected function defineErrorTypes() {
    return array(
      self::ERR_PERMISSION => pht(
        'Only an authenticated administrator account may call this method.'),
      self::ERR_PARAMETER => pht('A parameter is missing or malformed.'),
      self::ERR_READ_ONLY => pht(
        'Phorge is in read-only mode; tasks can not run now.'),
    );
  }

  final protected function execute(ConduitAPIRequest $request) {
    $this->requireBridgeCaller($request);
    return $this->executeBridgeMethod($request);
  }

  abstract protected function executeBridgeMethod(ConduitAPIRequest $request);

  private function requireBridgeCaller(ConduitAPIRequest $request) {
    // getUser() throws when there is no user at all.
    $viewer = $request->getUser();

    $reason = null;
    if (!$viewer->isLoggedIn()) {
      // Anonymous, "public" and intracluster public users have no PHID.
      $reason = pht('The caller is not logged in.');
    } else if ($viewer->isOmnipotent()) {
      $reason = pht('The omnipotent user may not call this method.');
    } else if ($request->getOAuthToken()) {
      $reason = pht('OAuth access tokens may not call this method.');
    } else if (!$viewer->isUserActivated()) {
      $reason = pht('The calling account is disabled or not activated.');
    } else if ($viewer->getIsMailingList()) {
      $reason = pht('Mailing lists may not call this method.');
    } else if (!$viewer->getIsAdmin()) {
      $reason = pht(
        'The calling account ("%s") is not an administrator.',
        $viewer->getUsername());
    }

    if ($reason !== null) {
      throw id(new ConduitException(self::ERR_PERMISSION))
        ->setErrorDescription(
          pht(
            'Permission denied: %s Only an administrator account (for '.
            'example, a bot made administrator for phorge-bridge) may call '.
            '"%s".',
            $reason,
            $this->getAPIMethodName()));
    }
  }

  final protected function newParameterException($message) {
    return id(new ConduitException(self::ERR_PARAMETER))
      ->setErrorDescription($message);
  }

  final protected function readInteger(
    ConduitAPIRequest $request,
    $key,
    $minimum) {

    $value = $request->getValue($key);
    if (is_string($value) && preg_match('/^-?\d+\z/', $value)) {
      $value = (int)$value;
    }
    if (!is_int($value) || $value < $minimum) {
      throw $this->newParameterException(
        pht(
          'Parameter "%s" must be an integer no smaller than %d.',
          $key,
          $minimum));
    }
    return $value;
  }

  final protected function readOptionalString(ConduitAPIRequest $request, $key) {
    $value = $request->getValue($key);
    if ($value === null || $value === '') {
      return null;
    }
    if (!is_string($value)) {
      throw $this->newParameterException(
        pht('Parameter "%s" must be a string or null.', $key));
    }
    return $value;
  }

  final protected static function cleanMessage($message) {
    $message = phutil_utf8ize((string)$message);
    return id(new PhutilUTF8StringTruncator())
      ->setMaximumBytes(4096)
      ->truncateString($message);
  }

}


final class PhorgeBridgeWorkerExecuteConduitAPIMethod
  extends PhorgeBridgeConduitAPIMethod {

  const RESULT_SUCCESS = 'success';
  const RESULT_YIELD = 'yield';
  const RESULT_PERMANENT_FAILURE = 'permanent-failure';
  const RESULT_FAILURE = 'failure';

  public function getAPIMethodName() {
    return 'worker.execute';
  }

  public function getMethodDescription() {
    return pht(
      'Run one task of the worker queue in this process, on behalf of '.
      'phorge-bridge, which holds the task\'s lease. Reports the outcome '.
      '(success, yield, permanent-failure or failure) and returns the '.
      'follow-up tasks the worker queued instead of scheduling them. Does '.
      'not read or write the queue tables. Administrators only.');
  }

  protected function defineParamTypes() {
    return array(
      'taskID' => 'required int',
      'taskClass' => 'required string',
      'data' => 'required string',
      'failureCount' => 'required int',
      'priority' => 'required int',
      'objectPHID' => 'optional phid|null',
      'containerPHID' => 'optional phid|null',
      'traceparent' => 'optional string|null',
    );
  }

  protected function defineReturnType() {
    return 'dict<string, wild>';
  }

  protected function executeBridgeMethod(ConduitAPIRequest $request) {
    $task_id = $this->readInteger($request, 'taskID', 1);
    $failure_count = $this->readInteger($request, 'failureCount', 0);
    $priority = $this->readInteger($request, 'priority', 0);
    $object_phid = $this->readOptionalString($request, 'objectPHID');
    $container_phid = $this->readOptionalString($request, 'containerPHID');

    $task_class = $request->getValue('taskClass');
    if (!is_string($task_class) || !strlen($task_class)) {
      throw $this->newParameterException(
        pht('Parameter "taskClass" must be a non-empty string.'));
    }

    $raw_data = $request->getValue('data');
    if (!is_string($raw_data)) {
      throw $this->newParameterException(
        pht(
          'Parameter "data" must be the raw JSON string of the task\'s '.
          'worker_taskdata row.'));
    }

    if (PhabricatorEnv::isReadOnly()) {
      throw id(new ConduitException(self::ERR_READ_ONLY))
        ->setErrorDescription(
          pht('Phorge is in read-only mode; task %d was not run.', $task_id));
    }

    // Exactly how PhabricatorWorkerTaskData reads its "data" column
    // (LiskDAO::SERIALIZATION_JSON): invalid JSON becomes null, as in Phorge.
    $data = json_decode($raw_data, true);

    // An in-memory task for the worker's getCurrentWorkerTask() and
    // getWaitBeforeRetry(); ephemeral, so nothing can ever save it.
    $task = id(new PhabricatorWorkerActiveTask())
      ->setID($task_id)
      ->setTaskClass($task_class)
      ->setData($data)
      ->setFailureCount($failure_count)
      ->setPriority($priority)
      ->setObjectPHID($object_phid)
      ->setContainerPHID($container_phid);
    $task->makeEphemeral();

    // The daemons run workers without a time limit; so must we. The bridge
    // bounds the wait on its side.
    if (function_exists('set_time_limit')) {
      @set_time_limit(0);
    }

    return $this->runTask($task, $failure_count, $priority);
  }

  private function runTask(
    PhabricatorWorkerActiveTask $task,
    $failure_count,
    $priority) {

    $result = array(
      'result' => null,
      'duration' => 0,
      'followups' => array(),
      'yieldDuration' => null,
      'retryWait' => null,
      'message' => null,
      'requiredLease' => null,
      'maximumRetryCount' => null,
      'warnings' => array(),
    );

    $worker = null;
    $caught = null;
    $buffer_level = ob_get_level();
    ob_start();
    try {
      $worker = $this->newWorker($task->getTaskClass(), $task->getData());
      $worker->setCurrentWorkerTask($task);

      // Phorge's rule (PhabricatorWorkerActiveTask::executeTask).
      $maximum_failures = $worker->getMaximumRetryCount();
      $result['maximumRetryCount'] = $maximum_failures;
      if ($maximum_failures !== null) {
        if ($failure_count > $maximum_failures) {
          throw new PhabricatorWorkerPermanentFailureException(
            pht(
              'Task %d has exceeded the maximum number of failures (%d).',
              $task->getID(),
              $maximum_failures));
        }
      }

      $lease = $worker->getRequiredLeaseTime();
      $result['requiredLease'] = ($lease === null ? null : (int)$lease);

      $t_start = microtime(true);
        $worker->executeTask();
      $duration = phutil_microseconds_since($t_start);

      $result['result'] = self::RESULT_SUCCESS;
      $result['duration'] = (int)$duration;
    } catch (PhabricatorWorkerPermanentFailureException $ex) {
      $result['result'] = self::RESULT_PERMANENT_FAILURE;
      $message = $ex->getMessage();
      if (!strlen($message)) {
        $message = pht('%s (no message)', get_class($ex));
      }
      $result['message'] = self::cleanMessage($message);
    } catch (PhabricatorWorkerYieldException $ex) {
      $result['result'] = self::RESULT_YIELD;
      $result['yieldDuration'] = max((int)$ex->getDuration(), 5);
    } catch (Exception $ex) {
      $caught = $ex;
    } catch (Throwable $ex) {
      $caught = $ex;
    }

    // Whatever a worker printed would corrupt the JSON response.
    while (ob_get_level() > $buffer_level) {
      ob_end_clean();
    }

    if ($caught) {
      // As Phorge does before asking the worker for its wait: the task shows
      // the exception and the failure count including this failure.
      $task->setExecutionException($caught);
      $task->setFailureCount($failure_count + 1);
      $task->setFailureTime(time());

      $retry = null;
      if ($worker) {
        try {
          $retry = $worker->getWaitBeforeRetry($task);
        } catch (Exception $ex) {
          $result['warnings'][] = self::cleanMessage(
            pht('getWaitBeforeRetry() failed: %s', $ex->getMessage()));
        }
      }
      $retry = coalesce(
        $retry,
        PhabricatorWorkerLeaseQuery::getDefaultWaitBeforeRetry());

      $result['result'] = self::RESULT_FAILURE;
      $result['retryWait'] = (int)$retry;
      $result['message'] = self::cleanMessage(
        get_class($caught).': '.$caught->getMessage());
    }

    if ($result['result'] === self::RESULT_SUCCESS) {
      $result['followups'] = $this->describeFollowups(
        $worker,
        $priority,
        $result['warnings']);
    }

    return $result;
  }

  private function newWorker($class, $data) {
    if (!preg_match('/^[A-Za-z_][A-Za-z0-9_]*\z/', $class)) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht('Task class "%s" is not a valid class name.', $class));
    }

    // Unlike the daemon (which lets the autoloader throw and so retries a
    // missing class forever), the bridge archives it: the class is unknown
    // to this Phorge.
    try {
      $exists = class_exists($class);
    } catch (Exception $ex) {
      $exists = false;
    }
    if (!$exists) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht("Task class '%s' does not exist!", $class));
    }

    if (!is_subclass_of($class, 'PhabricatorWorker')) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht(
          "Task class '%s' does not extend %s.",
          $class,
          'PhabricatorWorker'));
    }

    $reflection = new ReflectionClass($class);
    if ($reflection->isAbstract()) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht("Task class '%s' is abstract.", $class));
    }

    return newv($class, array($data));
  }

  /**
   * The tasks the worker queued with queueTask(), as flushTaskQueue() would
   * schedule them after a success, but returned instead of scheduled: the
   * bridge inserts them in the transaction that archives this task.
   */
  private function describeFollowups(
    PhabricatorWorker $worker,
    $priority,
    array &$warnings) {

    // getQueuedTasks() is protected; read it in PhabricatorWorker's scope.
    $reader = Closure::bind(
      function () {
        return $this->getQueuedTasks();
      },
      $worker,
      'PhabricatorWorker');
    $queued = $reader();

    // flushTaskQueue() defaults follow-ups to the finished task's priority.
    $defaults = array(
      'priority' => (int)$priority,
    );

    $followups = array();
    foreach ($queued as $spec) {
      list($class, $data, $options) = $spec;
      if (!is_array($options)) {
        $options = array();
      }
      $options = $options + $defaults;

      try {
        // What scheduleTask() accepts; an invalid follow-up would make
        // Phorge throw after archiving the task, so it is left out here.
        PhutilTypeSpec::checkMap(
          $options,
          array(
            'priority' => 'optional int|null',
            'objectPHID' => 'optional string|null',
            'containerPHID' => 'optional string|null',
            'delayUntil' => 'optional int|null',
          ));
        if (!is_string($class) || !strlen($class)) {
          throw new Exception(pht('Follow-up task class must be a string.'));
        }
        if (@json_encode($data) === false) {
          throw new Exception(
            pht('Follow-up data can not be JSON encoded: %s', json_last_error_msg()));
        }
      } catch (Exception $ex) {
        $warnings[] = self::cleanMessage(
          pht(
            'Dropped follow-up task "%s": %s',
            is_string($class) ? $class : gettype($class),
            $ex->getMessage()));
        continue;
      }

      $task_priority = idx($options, 'priority');
      if ($task_priority === null) {
        // scheduleTask(): an explicit null priority means the default.
        $task_priority = PhabricatorWorker::PRIORITY_DEFAULT;
      }

      $delay = idx($options, 'delayUntil');
      $followups[] = array(
        'taskClass' => $class,
        'data' => $data,
        'options' => array(
          'priority' => (int)$task_priority,
          'objectPHID' => idx($options, 'objectPHID'),
          'containerPHID' => idx($options, 'containerPHID'),
          // scheduleTask() ignores a zero delay.
          'delayUntil' => ($delay ? (int)$delay : null),
        ),
      );
    }

    return $followups;
  }

}


final class PhorgeBridgeFeedStoryConduitAPIMethod
  extends PhorgeBridgeConduitAPIMethod {

  public function getAPIMethodName() {
    return 'worker.feedstory';
  }

  public function getMethodDescription() {
    return pht(
      'For a feed story\'s chronological key, return the fields '.
      'FeedPublisherHTTPWorker would POST to feed.http-hooks, whether hooks '.
      'are silenced (phabricator.silent) and the allowed hook URIs, so '.
      'phorge-bridge can deliver the hook itself. Administrators only.');
  }

  protected function defineParamTypes() {
    return array(
      'key' => 'required string',
    );
  }

  protected function defineReturnType() {
    return 'dict<string, wild>';
  }

  protected function executeBridgeMethod(ConduitAPIRequest $request) {
    // Chronological keys exceed 2^53: they travel as strings.
    $key = $request->getValue('key');
    if (is_int($key)) {
      $key = (string)$key;
    }
    if (!is_string($key) || !preg_match('/^\d{1,20}\z/', $key)) {
      throw $this->newParameterException(
        pht('Parameter "key" must be a chronological key (a decimal string).'));
    }

    $silent = (bool)PhabricatorEnv::getEnvConfig('phabricator.silent');
    $hook_uris = PhabricatorEnv::getEnvConfig('feed.http-hooks');
    if (!is_array($hook_uris)) {
      $hook_uris = array();
    }

    // As FeedPushWorker::loadFeedStory().
    $story = id(new PhabricatorFeedQuery())
      ->setViewer(PhabricatorUser::getOmnipotentUser())
      ->withChronologicalKeys(array($key))
      ->executeOne();

    $fields = null;
    if ($story) {
      $data = $story->getStoryData();
      // The same fields, in the same order, as FeedPublisherHTTPWorker.
      $fields = array(
        'storyID' => $data->getID(),
        'storyType' => $data->getStoryType(),
        'storyData' => $data->getStoryData(),
        'storyAuthorPHID' => $data->getAuthorPHID(),
        'storyText' => $story->renderText(),
        'epoch' => $data->getEpoch(),
      );
    }

    return array(
      'key' => $key,
      'silent' => $silent,
      'hookURIs' => array_values($hook_uris),
      'story' => $fields,
      // What HTTPSFuture sends when no User-Agent is set, so the bridge's POST
      // carries the same one.
      'userAgent' => self::getHTTPUserAgent(),
    );
  }

  private static function getHTTPUserAgent() {
    $client = 'Arcanist/1.0';
    if (method_exists('BaseHTTPFuture', 'getDefaultUserAgent')) {
      $client = BaseHTTPFuture::getDefaultUserAgent();
    }
    if (!function_exists('curl_version')) {
      return $client;
    }
    $curl = curl_version();
    return $client.' cURL/'.idx($curl, 'version');
  }

}


final class PhorgeBridgeVersionConduitAPIMethod
  extends PhorgeBridgeConduitAPIMethod {

  public function getAPIMethodName() {
    return 'worker.version';
  }

  public function getMethodDescription() {
    return pht(
      'Report which phorge-bridge extension is installed: its release and '.
      'the sha256 of this file, which phorge-bridge doctor compares with the '.
      'copy it ships. Administrators only.');
  }

  protected function defineParamTypes() {
    return array();
  }

  protected function defineReturnType() {
    return 'dict<string, string>';
  }

  protected function executeBridgeMethod(ConduitAPIRequest $request) {
    return array(
      'version' => self::VERSION,
      'sha256' => hash_file('sha256', __FILE__),
    );
  }

}
